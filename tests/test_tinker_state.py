"""Training state through the official `tinker` SDK: save_state / load_state (with and without
AdamW's moments), create_training_client_from_state[_with_optimizer] after a server restart, the
RestClient listings, and that none of it crosses API keys.

One server trains a LoRA 4 steps (saving the state after steps 2 and 3) and stops; a new server on
the same store_dir and database resumes from the step-2 state, and must reproduce steps 3 and 4
of the run that was never interrupted. The real in-process trainer, the transformers sampler.
"""
from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from _tinker_server import KEY_A, KEY_B, running_server, service_client  # noqa: E402

PROMPT = "the red square is red and the blue circle is blue"
LR = 1e-2
# no weight decay: a fresh Adam's first step then moves every weight by lr * g/(|g| + eps) ~ lr
ADAM = types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


def make_datum(tokenizer) -> types.Datum:
    ids = tokenizer.encode(PROMPT)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64)})


def train_step(tc, datum) -> float:
    fb = tc.forward_backward([datum], "cross_entropy")
    opt = tc.optim_step(ADAM)
    loss = fb.result().metrics["loss:sum"]
    opt.result()
    return loss


def forward_logprobs(tc, datum) -> np.ndarray:
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def adapter(store_dir, path: str) -> dict[str, np.ndarray]:
    """The LoRA tensors a state checkpoint holds (its folder in the store)."""
    from safetensors.numpy import load_file

    run, _, name = path[len("tinker://"):].split("/")
    files = list((store_dir / "checkpoints" / run / "weights").glob(f"{name}.*/adapter.safetensors"))
    assert len(files) == 1, files
    return load_file(str(files[0]))


def step_sizes(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> np.ndarray:
    """|change| / lr of every LoRA weight that moved."""
    delta = np.concatenate([np.abs(after[k] - before[k]).ravel() for k in before])
    return delta[delta > 0] / LR


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-state")


@pytest.fixture(scope="module")
def first_run(tiny_model_dir, store_dir):
    """The uninterrupted run, on a server that is then stopped: 4 steps, states saved after steps
    2 and 3, the losses, and the logprobs after step 4. A save that a kill interrupted is left in
    the store (a `.tmp-` folder), as a crash would leave it."""
    with running_server(tiny_model_dir, store_dir) as url:
        tc = service_client(url).create_lora_training_client(base_model="tiny-vlm", rank=4, seed=0).result()
        datum = make_datum(tc.get_tokenizer())
        losses = [train_step(tc, datum), train_step(tc, datum)]
        step2 = tc.save_state("step2", user_metadata={"note": "after step 2"}).result().path
        losses.append(train_step(tc, datum))
        step3 = tc.save_state("step3").result().path
        losses.append(train_step(tc, datum))
        final = forward_logprobs(tc, datum)
        sampler_path = tc.save_weights_for_sampler("s4").result().path
    partial = store_dir / "checkpoints" / tc.model_id / "weights" / ".tmp-killed"
    partial.mkdir()
    (partial / "adapter.safetensors").write_bytes(b"half a file")
    return {"run": tc.model_id, "datum": datum, "losses": losses, "final": final, "step2": step2,
            "step3": step3, "sampler_path": sampler_path, "partial": partial}


@pytest.fixture(scope="module")
def server(first_run, tiny_model_dir, store_dir):
    """A new server on the first one's store_dir (and its SQLite database)."""
    with running_server(tiny_model_dir, store_dir) as url:
        yield url


def test_save_state_paths_name_the_run(first_run):
    assert first_run["step2"] == f"tinker://{first_run['run']}/weights/step2"
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(first_run["step2"])
    assert (parsed.training_run_id, parsed.checkpoint_type) == (first_run["run"], "training")


def test_resume_with_optimizer_after_restart_matches_the_uninterrupted_run(first_run, server):
    tc = service_client(server).create_training_client_from_state_with_optimizer(first_run["step2"]).result()
    assert tc.get_info().lora_rank == 4
    datum = first_run["datum"]
    resumed = [train_step(tc, datum), train_step(tc, datum)]
    np.testing.assert_allclose(resumed, first_run["losses"][2:], rtol=1e-5)
    np.testing.assert_allclose(forward_logprobs(tc, datum), first_run["final"], atol=1e-5)


def test_weights_only_restarts_adam_and_with_optimizer_continues_it(first_run, server, store_dir):
    datum = first_run["datum"]
    at2, at3 = adapter(store_dir, first_run["step2"]), adapter(store_dir, first_run["step3"])
    fresh = service_client(server).create_training_client_from_state(first_run["step2"]).result()
    # the weights are the step-2 weights: the loss of step 3 is the uninterrupted run's
    assert train_step(fresh, datum) == pytest.approx(first_run["losses"][2], rel=1e-5)
    fresh_at3 = adapter(store_dir, fresh.save_state("fresh-step3").result().path)
    # a first Adam step (no moments): every weight moves by ~lr; with the restored moments
    # (the uninterrupted run's step 3) the steps are spread out, and the weights differ
    fresh_sizes, resumed_sizes = step_sizes(at2, fresh_at3), step_sizes(at2, at3)
    assert fresh_sizes.max() <= 1 + 1e-3 and np.quantile(fresh_sizes, 0.05) > 0.9, fresh_sizes
    assert np.median(resumed_sizes) < 0.9, np.median(resumed_sizes)
    assert max(np.abs(fresh_at3[k] - at3[k]).max() for k in at3) > 0.1 * LR


def test_load_state_into_a_training_client_with_and_without_optimizer(first_run, server, store_dir):
    datum = first_run["datum"]
    tc = service_client(server).create_lora_training_client(base_model="tiny-vlm", rank=4, seed=1).result()
    with pytest.warns(FutureWarning, match="load_state"):  # the SDK deprecates load_state*
        tc.load_state_with_optimizer(first_run["step2"]).result()
    assert train_step(tc, datum) == pytest.approx(first_run["losses"][2], rel=1e-5)
    with_opt = adapter(store_dir, tc.save_state("loaded-opt").result().path)
    at3 = adapter(store_dir, first_run["step3"])
    for k in at3:
        np.testing.assert_allclose(with_opt[k], at3[k], atol=1e-6, err_msg=k)
    # weights only: the client's own Adam moments (from the step above) are dropped too
    with pytest.warns(FutureWarning, match="load_state"):
        tc.load_state(first_run["step2"]).result()
    train_step(tc, datum)
    sizes = step_sizes(adapter(store_dir, first_run["step2"]),
                       adapter(store_dir, tc.save_state("loaded-weights").result().path))
    assert sizes.max() <= 1 + 1e-3 and np.quantile(sizes, 0.05) > 0.9


def test_listings_survive_the_restart(first_run, server):
    rest = tinker.RestClient(base_url=server, api_key=KEY_A)
    run = rest.get_training_run(first_run["run"]).result()
    assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank) == (first_run["run"], "tiny-vlm", True, 4)
    assert run.last_checkpoint.tinker_path == first_run["step3"]
    assert run.last_sampler_checkpoint.tinker_path == first_run["sampler_path"]
    assert rest.get_training_run_by_tinker_path(first_run["step2"]).result().training_run_id == first_run["run"]
    cks = rest.list_checkpoints(first_run["run"]).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in cks] == [
        ("weights/step2", "training"), ("weights/step3", "training"), ("sampler_weights/s4", "sampler")]
    assert all(c.size_bytes > 0 and c.tinker_path.startswith(f"tinker://{first_run['run']}/") for c in cks)
    assert cks[0].user_metadata == {"note": "after step 2"} and cks[1].user_metadata is None
    mine = rest.list_user_checkpoints().result()
    assert {first_run["step2"], first_run["step3"]} <= {c.tinker_path for c in mine.checkpoints}
    assert mine.cursor.total_count == len(mine.checkpoints)
    runs = rest.list_training_runs(limit=100).result()
    assert first_run["run"] in [r.training_run_id for r in runs.training_runs]
    info = rest.get_weights_info_by_tinker_path(first_run["step2"]).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_mlp) == ("tiny-vlm", True, 4, True)


def test_a_run_from_before_the_restart_says_how_to_resume(first_run, server):
    import httpx

    r = httpx.post(f"{server}/api/v1/optim_step", headers={"X-API-Key": KEY_A},
                   json={"model_id": first_run["run"], "adam_params": {"learning_rate": LR}})
    assert r.status_code == 404
    assert first_run["run"] in r.json()["error"] and "create_training_client_from_state" in r.json()["error"]


def test_a_save_a_kill_interrupted_is_swept_not_listed(first_run, server):
    assert not first_run["partial"].exists()
    cks = tinker.RestClient(base_url=server, api_key=KEY_A).list_user_checkpoints().result().checkpoints
    assert not any("killed" in c.tinker_path for c in cks)


def test_another_key_cannot_see_load_list_or_delete(first_run, server):
    path, run = first_run["step2"], first_run["run"]
    other = service_client(server, KEY_B)
    with pytest.raises(tinker.NotFoundError, match=path):
        other.create_training_client_from_state_with_optimizer(path).result()
    own = other.create_lora_training_client(base_model="tiny-vlm", rank=4).result()
    with pytest.raises(tinker.NotFoundError, match=path), pytest.warns(FutureWarning):
        own.load_state(path).result()
    rest = tinker.RestClient(base_url=server, api_key=KEY_B)
    for call in (lambda: rest.get_training_run(run), lambda: rest.list_checkpoints(run),
                 lambda: rest.delete_checkpoint_from_tinker_path(path)):
        with pytest.raises(tinker.NotFoundError, match=run):
            call().result()
    with pytest.raises(tinker.NotFoundError, match=path):
        rest.get_weights_info_by_tinker_path(path).result()
    assert [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints] == []
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [own.model_id]
    owner_view = tinker.RestClient(base_url=server, api_key=KEY_A).list_checkpoints(run).result()
    assert path in [c.tinker_path for c in owner_view.checkpoints]  # B's delete removed nothing


def test_bad_and_unknown_paths_are_errors_naming_the_path(first_run, server):
    service = service_client(server)
    for bad in ("tinker://only-a-run", f"tinker://{first_run['run']}/optimizer/step2", "step2"):
        with pytest.raises(tinker.BadRequestError, match=bad):
            service.create_training_client_from_state(bad).result()
    rest = tinker.RestClient(base_url=server, api_key=KEY_A)
    with pytest.raises(tinker.BadRequestError, match="tinker://only-a-run"):
        rest.get_weights_info_by_tinker_path("tinker://only-a-run").result()
    unknown = f"tinker://{first_run['run']}/weights/never-saved"
    with pytest.raises(tinker.NotFoundError, match=unknown):
        service.create_training_client_from_state(unknown).result()
    with pytest.raises(tinker.BadRequestError, match="sampler weights"):
        service.create_training_client_from_state(first_run["sampler_path"]).result()
    rank8 = service.create_lora_training_client(base_model="tiny-vlm", rank=8).result()
    with pytest.raises(Exception, match=rf"{first_run['step2']}.*shape"), pytest.warns(FutureWarning):
        rank8.load_state(first_run["step2"]).result()


def test_save_overwrite_and_delete(first_run, server, store_dir):
    tc = service_client(server).create_training_client_from_state(first_run["step2"]).result()
    path = tc.save_state("scratch").result().path
    with pytest.raises(tinker.BadRequestError, match=path):
        tc.save_state("scratch").result()
    train_step(tc, first_run["datum"])
    assert tc.save_state("scratch", overwrite=True).result().path == path
    folders = list((store_dir / "checkpoints" / tc.model_id / "weights").iterdir())
    assert len(folders) == 1  # the overwritten state's folder is gone
    rest = tinker.RestClient(base_url=server, api_key=KEY_A)
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert not folders[0].exists()
    with pytest.raises(tinker.NotFoundError, match=path):
        service_client(server).create_training_client_from_state(path).result()


def test_a_failed_save_leaves_no_folder(tiny_model_dir, tmp_path, monkeypatch):
    import safetensors.torch
    import torch

    from mmrl.serve import state
    from mmrl.serve.trainer import LoraTrainer

    trainer = LoraTrainer(str(tiny_model_dir), rank=2, alpha=None, seed=0)
    trainer.optimizer = torch.optim.AdamW(trainer.params)
    for p in trainer.params:
        p.grad = p.detach().clone()
    trainer.optimizer.step()  # AdamW state exists: the save writes a second file
    real, calls = safetensors.torch.save_file, []

    def fail_on_second_file(tensors, filename, *args, **kwargs):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", fail_on_second_file)
    with pytest.raises(OSError, match="disk full"):
        state.write_state(trainer, tmp_path / "weights", "step1", {"base_model": "tiny-vlm"})
    assert len(calls) == 2 and list((tmp_path / "weights").iterdir()) == []


def test_a_database_from_an_older_server_gets_the_new_columns(tmp_path):
    import sqlalchemy

    from mmrl.serve.auth import owner_id
    from mmrl.serve.store import Store

    url = f"sqlite:///{tmp_path / 'old.db'}"
    with sqlalchemy.create_engine(url).begin() as c:  # the checkpoints table as the first cut made it
        c.execute(sqlalchemy.text("CREATE TABLE checkpoints (path VARCHAR(512) PRIMARY KEY, owner VARCHAR(64) "
                                  "NOT NULL, model_id VARCHAR(64) NOT NULL, kind VARCHAR(16) NOT NULL, name "
                                  "VARCHAR(256) NOT NULL, file TEXT NOT NULL, created FLOAT NOT NULL)"))
        c.execute(sqlalchemy.text("INSERT INTO checkpoints VALUES ('tinker://m/sampler_weights/old', 'o', 'm', "
                                  "'sampler', 'old', '/x', 1.0)"))
    store = Store(url)
    a = owner_id("tml-a")
    store.add_checkpoint(a, "tinker://m/weights/new", "m", "state", "new", "/y", 123, '{"step": "2"}')
    row = store.checkpoint(a, "tinker://m/weights/new")
    assert (row["size_bytes"], row["user_metadata"]) == (123, '{"step": "2"}')
    assert store.checkpoint("o", "tinker://m/sampler_weights/old")["size_bytes"] is None
