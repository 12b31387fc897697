"""The synthetic GUI environment (tool "gui"): real Pillow rendering, real state transitions."""
from __future__ import annotations

import asyncio
import io
import json
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from mmrl.data.sample import Sample
from mmrl.registry import resolve
from mmrl.tools.base import ToolError, ToolResult, run_tool
from mmrl.tools.gui import (MARK_BG, TASKS, DesktopSpec, GuiEnvironment, cell_centre, cell_for_box, clickable,
                            expert_actions, render_screen)


def make_env(spec: DesktopSpec, **args) -> GuiEnvironment:
    sample = Sample(key="s", messages=[], images=[render_screen(spec)],
                    metadata={"gui": json.loads(json.dumps(spec.to_dict()))})  # as a shard carries it
    return GuiEnvironment(sample, **args)


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def crop(img: Image.Image, box) -> np.ndarray:
    return np.asarray(img.crop(tuple(box)))


@pytest.fixture
def click_spec() -> DesktopSpec:
    return DesktopSpec.generate(7, task="gui_click")


def test_registered_and_functions(click_spec):
    assert resolve("tool", "gui") is GuiEnvironment
    env = make_env(click_spec)
    fns = {f["function"]["name"]: f["function"] for f in env.functions()}
    assert set(fns) == {"click", "type"}
    assert fns["click"]["parameters"]["properties"]["x"]["maximum"] == click_spec.width - 1
    assert make_env(click_spec, grid=8).functions()[0]["function"]["parameters"]["properties"]["y"]["maximum"] == 7


def test_same_seed_same_screen_and_different_seed_differs():
    a, b = DesktopSpec.generate(11, task="any"), DesktopSpec.generate(11, task="any")
    assert a == b and png(render_screen(a)) == png(render_screen(b))
    # a recipe's per-sample generator gives the layout of the same seed list (and no stored seed)
    from_rng = DesktopSpec.generate(np.random.default_rng([0, 1, 11]))
    assert from_rng.seed is None and replace(from_rng, seed=[0, 1, 11]) == DesktopSpec.generate([0, 1, 11])
    c = DesktopSpec.generate(12, task="any")
    assert c != a and render_screen(c).tobytes() != render_screen(a).tobytes()


def test_spec_round_trips_through_json(click_spec):
    text = json.dumps(click_spec.to_dict())
    back = DesktopSpec.from_dict(json.loads(text))
    assert back == click_spec and DesktopSpec.from_dict(text) == click_spec
    assert render_screen(back).tobytes() == render_screen(click_spec).tobytes()
    with pytest.raises(ValueError, match="not a gui DesktopSpec"):
        DesktopSpec.from_dict({"width": 256})


def test_layout_invariants_over_seeds():
    for seed in range(40):
        for task in TASKS:
            spec = DesktopSpec.generate(seed, task=task)
            for e in spec.elements:
                if e.kind in ("menu", "item", "button", "field"):
                    x0, y0, x1, y1 = e.box
                    assert x1 - x0 >= 40 and y1 - y0 >= 40, e
            window = spec.window
            assert all(e.box[1] >= 40 for e in spec.elements if e.kind == "item")
            assert window[1] >= 40 + 8 and window[3] <= spec.height  # the window never hides the menu bar


def test_open_menu_changes_the_screen(click_spec):
    closed = render_screen(click_spec)
    opened = render_screen(click_spec, open_menu=click_spec.task.menu)
    assert closed.tobytes() != opened.tobytes()
    item = click_spec.element(click_spec.task.target_key())
    assert not np.array_equal(crop(closed, item.box), crop(opened, item.box))  # the drop-down appears


def test_click_menu_then_target_item_succeeds(click_spec):
    env = make_env(click_spec)
    before = env.screenshot()
    res = env.call("click", dict(zip("xy", click_spec.element("menu:" + click_spec.task.menu).centre)))
    assert res.text == f"opened menu '{click_spec.task.menu}'" and not res.done
    assert len(res.images) == 1 and res.images[0].size == (click_spec.width, click_spec.height)
    item = click_spec.element(click_spec.task.target_key())
    assert not np.array_equal(crop(before, item.box), crop(res.images[0], item.box))
    assert res.images[0].tobytes() == render_screen(click_spec, open_menu=click_spec.task.menu).tobytes()
    assert env.state()["open_menu"] == click_spec.task.menu and env.state()["progress"] == 0.5
    assert env.state()["success"] is False
    res = env.call("click", dict(zip("xy", item.centre)))
    assert res.done and f"'{click_spec.task.item}'" in res.text
    st = env.state()
    assert st["success"] is True and st["done"] is True and st["steps"] == 2 and st["progress"] == 1.0
    assert st["open_menu"] is None and st["command"] == click_spec.task.target_key()
    with pytest.raises(ToolError, match="episode is over"):
        env.call("click", {"x": 1, "y": 1})


def test_click_on_nothing_changes_nothing(click_spec):
    env = make_env(click_spec)
    before = env.screenshot().tobytes()
    title_bar = click_spec.window[0] + 4, click_spec.window[1] + 4  # not interactive
    res = env.call("click", {"x": title_bar[0], "y": title_bar[1]})
    assert res.text == "nothing there" and not res.done
    assert res.images[0].tobytes() == before
    assert env.state()["steps"] == 1 and env.state()["success"] is False and env.state()["open_menu"] is None


def test_open_menu_is_closed_by_a_click_elsewhere_and_switched_by_another_header(click_spec):
    env = make_env(click_spec)
    menus = [e for e in click_spec.elements if e.kind == "menu"]
    env.call("click", dict(zip("xy", menus[0].centre)))
    res = env.call("click", dict(zip("xy", menus[1].centre)))
    assert res.text == f"opened menu '{menus[1].label}'" and env.open_menu == menus[1].label
    button = next(e for e in click_spec.elements if e.kind == "button")
    res = env.call("click", dict(zip("xy", button.centre)))  # an open menu swallows the click
    assert res.text == f"closed menu '{menus[1].label}'" and not res.done and env.command is None
    assert res.images[0].tobytes() == render_screen(click_spec).tobytes()


def test_wrong_item_ends_unsuccessfully(click_spec):
    env = make_env(click_spec)
    task = click_spec.task
    wrong = next(e for e in click_spec.elements if e.kind == "item" and e.menu == task.menu and e.label != task.item)
    env.call("click", dict(zip("xy", click_spec.element("menu:" + task.menu).centre)))
    res = env.call("click", dict(zip("xy", wrong.centre)))
    assert res.done and res.text.startswith(f"clicked '{wrong.label}'")
    st = env.state()
    assert st["success"] is False and st["done"] is True and st["command"] == wrong.key and st["progress"] == 0.5


def test_buttons_task_right_and_wrong():
    spec = DesktopSpec.generate(3, task="gui_button")
    wrong = next(e for e in spec.elements if e.kind == "button" and e.key != spec.task.target_key())
    env = make_env(spec)
    assert env.call("click", dict(zip("xy", wrong.centre))).done and env.state()["success"] is False
    env = make_env(spec)
    res = env.call("click", dict(zip("xy", spec.element(spec.task.target_key()).centre)))
    assert res.text.startswith(f"clicked button '{spec.task.button}'") and env.state()["success"] is True


def test_type_task():
    spec = DesktopSpec.generate(5, task="gui_type")
    env = make_env(spec)
    with pytest.raises(ToolError, match="click the text field first"):
        env.call("type", {"text": spec.task.text})
    field = spec.element("field")
    assert env.call("click", dict(zip("xy", field.centre))).text == "focused the text field"
    res = env.call("type", {"text": spec.task.text})
    assert res.text == f"typed '{spec.task.text}'" and env.state()["field_text"] == spec.task.text
    assert not np.array_equal(crop(res.images[0], field.box), crop(render_screen(spec), field.box))
    assert env.state()["progress"] == pytest.approx(2 / 3)
    env.call("click", dict(zip("xy", spec.element(spec.task.target_key()).centre)))
    st = env.state()
    assert st == {**st, "success": True, "done": True, "steps": 4, "errors": 1, "progress": 1.0}
    # the right button with the wrong text is a failure
    env = make_env(spec)
    env.call("click", dict(zip("xy", field.centre)))
    env.call("type", {"text": spec.task.text + "x"})
    assert env.call("click", dict(zip("xy", spec.element(spec.task.target_key()).centre))).done
    assert env.state()["success"] is False


def test_bad_arguments_raise_tool_error(click_spec):
    env = make_env(click_spec)
    w, h = click_spec.width, click_spec.height
    for args in ({"x": w, "y": 10}, {"x": -1, "y": 0}, {"x": 3, "y": h}, {"x": "a", "y": 1},
                 {"x": True, "y": 1}, {"x": 1}, {"x": 1, "y": 1, "z": 0}, {"x": float("nan"), "y": 1}):
        with pytest.raises(ToolError):
            env.call("click", args)
    with pytest.raises(ToolError, match="unknown function"):
        env.call("scroll", {})
    with pytest.raises(ToolError, match="grid cells"):
        make_env(click_spec, grid=8).call("click", {"x": 8, "y": 0})
    assert env.state()["errors"] == 9 and env.state()["steps"] == 9 and not env.state()["done"]


def test_grid_maps_cells_to_pixels_and_expert_solves_every_task():
    assert cell_centre(0, 0, 256, 256, 8) == (16, 16)
    assert cell_centre(7, 7, 256, 256, 8) == (240, 240)
    assert cell_centre(3, 2, 320, 240, 8) == (140, 75)
    spec = DesktopSpec.generate(9, task="gui_click")
    env = make_env(spec, grid=8)
    assert env.to_pixels(3, 2) == (112, 80)
    menu = spec.element("menu:" + spec.task.menu)
    col, row = cell_for_box(menu.box, spec.width, spec.height, 8)
    assert menu.contains(*cell_centre(col, row, spec.width, spec.height, 8))
    assert env.call("click", {"x": col, "y": row}).text == f"opened menu '{spec.task.menu}'"
    for seed in range(6):
        for task in TASKS:
            for grid, size in ((None, (256, 256)), (8, (256, 256)), (8, (320, 240))):
                spec = DesktopSpec.generate(seed, task=task, width=size[0], height=size[1])
                env = make_env(spec, grid=grid)
                results = [env.call(f, a) for f, a in expert_actions(spec, grid=grid)]
                assert results[-1].done and env.state()["success"] is True, (seed, task, grid)
                assert not any(r.done for r in results[:-1])


def test_max_steps_ends_unsuccessfully(click_spec):
    env = make_env(click_spec, max_steps=2)
    title = click_spec.window[0] + 4, click_spec.window[1] + 4
    assert not env.call("click", {"x": title[0], "y": title[1]}).done
    res = env.call("click", {"x": title[0], "y": title[1]})
    assert res.done and "step limit" in res.text and env.state()["success"] is False


def test_missing_spec_is_a_clear_error():
    with pytest.raises(ValueError, match=r"metadata\['gui'\]"):
        GuiEnvironment(Sample(key="s", messages=[]))
    with pytest.raises(ValueError, match="grid"):
        make_env(DesktopSpec.generate(0), grid=1)


def test_run_tool_returns_a_result_with_one_image(click_spec):
    env = make_env(click_spec)
    x, y = click_spec.element("menu:" + click_spec.task.menu).centre
    result, seconds = asyncio.run(run_tool(env, "click", {"x": x, "y": y}, timeout_s=30))
    assert isinstance(result, ToolResult) and not result.error and seconds >= 0
    assert len(result.images) == 1 and isinstance(result.images[0], Image.Image)
    assert result.text == f"opened menu '{click_spec.task.menu}'"
    bad, _ = asyncio.run(run_tool(env, "click", {"x": 10_000, "y": 0}, timeout_s=30))
    assert bad.error and "off the screen" in bad.text


# ------------------------------------------------------------------------------- set-of-marks

def test_marks_tag_what_can_be_clicked_and_the_expert_solves_every_task():
    """marks=True: click(mark) clicks the element whose tag shows that number; the tags follow
    the state (menus keep their numbers, the open menu's items follow) and are drawn on the screenshot."""
    spec = DesktopSpec.generate(7, task="gui_click")
    env = make_env(spec, marks=True)
    (click, _) = env.functions()
    assert click["function"]["parameters"]["required"] == ["mark"]
    closed = clickable(spec)
    assert [e.kind for e in closed] == ["menu"] * 3 + ["field"] + ["button"] * (len(closed) - 4)
    tagged, plain = env.screenshot(), render_screen(spec)
    for e in closed:  # a red tag in the element's top-left corner
        tag = np.asarray(tagged)[e.box[1] + 2:e.box[1] + 14, e.box[0] + 1:e.box[0] + 4].reshape(-1, 3)
        assert (np.abs(tag.astype(int) - MARK_BG).sum(1) < 30).mean() > 0.5, e.key
        assert not np.array_equal(crop(tagged, e.box), crop(plain, e.box))
    menu = [e.label for e in closed].index(spec.task.menu)
    result = env.call("click", {"mark": menu})
    assert result.text == f"opened menu '{spec.task.menu}'"
    items = [e.label for e in clickable(spec, spec.task.menu)]
    assert items[:3] == [e.label for e in closed[:3]]  # a menu's number never changes
    assert items[3:] == [e.label for e in spec.elements if e.kind == "item" and e.menu == spec.task.menu]
    with pytest.raises(ToolError, match="0 to"):
        env.call("click", {"mark": len(items)})
    with pytest.raises(ToolError, match="exactly"):
        env.call("click", {"x": 1, "y": 2})
    assert env.call("click", {"mark": items.index(spec.task.item)}).done and env.state()["success"]
    for seed in range(6):
        for task in TASKS:
            spec = DesktopSpec.generate(seed, task=task)
            env = make_env(spec, marks=True)
            results = [env.call(f, a) for f, a in expert_actions(spec, marks=True)]
            assert results[-1].done and env.state()["success"] is True, (seed, task)
    with pytest.raises(ValueError, match="marks"):
        make_env(spec, marks=True, grid=8)


def test_list_marks_names_every_tag_of_the_new_screen_in_the_tool_text():
    """list_marks=True: after each action the tool's text lists the tags of the screenshot it
    returns, number then label, in click order; an action that ends the episode lists none."""
    spec = DesktopSpec.generate(3, task="gui_click", layout="fixed")
    env = make_env(spec, marks=True, list_marks=True)
    menus = [e.label for e in clickable(spec)][:3]
    opened = env.call("click", {"mark": menus.index(spec.task.menu)})
    shown = clickable(spec, spec.task.menu)
    assert opened.text == f"opened menu '{spec.task.menu}'. Marks: " + " ".join(
        f"{n} '{e.label}'" for n, e in enumerate(shown))
    assert [e.kind for e in shown] == ["menu"] * 3 + ["item"] * 3
    closed = env.call("click", {"mark": menus.index(spec.task.menu)})  # the open menu's header closes it
    assert closed.text.startswith(f"closed menu '{spec.task.menu}'. Marks: 0 '{menus[0]}'") and "'field'" in closed.text
    env.call("click", {"mark": menus.index(spec.task.menu)})
    done = env.call("click", {"mark": [e.label for e in shown].index(spec.task.item)})
    assert done.done and env.state()["success"] and "Marks" not in done.text
    assert "Marks" not in make_env(spec, marks=True).call("click", {"mark": 0}).text  # off by default
    with pytest.raises(ValueError, match="list_marks"):
        make_env(spec, list_marks=True)


def test_open_menus_adds_an_open_action_for_menu_headers_only():
    """open_menus=True: `open(mark)` opens the menu tagged `mark` (another open menu is replaced,
    the open one stays open); a tag that is not a menu header is refused with the headers' tags.
    `click` then refuses menu headers, in both states; without the option there is no `open`."""
    spec = DesktopSpec.generate(3, task="gui_click", layout="fixed")
    env = make_env(spec, marks=True, open_menus=True)
    assert [f["function"]["name"] for f in env.functions()] == ["click", "type", "open"]
    assert env.functions()[2]["function"]["parameters"]["required"] == ["mark"]
    menus = [e.label for e in clickable(spec)][:3]
    target, other = menus.index(spec.task.menu), (menus.index(spec.task.menu) + 1) % 3
    with pytest.raises(ToolError, match=r"open takes the tag of a menu header \(0, 1, 2\), got 3"):
        env.call("open", {"mark": 3})  # the text field
    assert env.call("open", {"mark": other}).text == f"opened menu '{menus[other]}'"
    assert env.call("open", {"mark": target}).text == f"opened menu '{spec.task.menu}'"  # replaces it
    assert env.call("open", {"mark": target}).text == f"menu '{spec.task.menu}' is open"
    with pytest.raises(ToolError, match="open takes the tag of a menu header"):
        env.call("open", {"mark": 3})  # an item of the open menu: clicked, not opened
    with pytest.raises(ToolError, match=r"menu headers are opened with open\(mark\), got 0"):
        env.call("click", {"mark": 0})  # a header, while a menu is open: refused, the menu stays open
    assert env.state()["errors"] == 3 and not env.state()["done"]
    item = [e.label for e in clickable(spec, spec.task.menu)].index(spec.task.item)
    assert env.call("click", {"mark": item}).done and env.state()["success"] and env.state()["errors"] == 3
    closed = make_env(spec, marks=True, open_menus=True)
    with pytest.raises(ToolError, match="menu headers are opened with open"):
        closed.call("click", {"mark": target})  # no menu open: refused too, nothing opens
    assert closed.open_menu is None
    assert "menu headers: open" in closed.functions()[0]["function"]["description"]
    with pytest.raises(ToolError, match=r"unknown function 'open'; use click\(mark\), type\(text\)$"):
        make_env(spec, marks=True).call("open", {"mark": 0})
    with pytest.raises(ValueError, match="open_menus"):
        make_env(spec, open_menus=True)
