"""`mmrl serve`'s keys and SQL store, without a model: one key never reads another key's rows, and
a restarted server keeps finished futures and fails the ones it left pending."""
from __future__ import annotations

import pytest

from mmrl.serve.auth import AuthError, KeyConfigError, Keys, load_keys, owner_id
from mmrl.serve.store import Store


def test_keys_need_the_tml_prefix_and_are_checked(tmp_path):
    with pytest.raises(KeyConfigError, match="tml-"):
        load_keys(env="tml-good,sk-bad")
    with pytest.raises(KeyConfigError, match="no API keys"):
        load_keys(env="")
    f = tmp_path / "keys.txt"
    f.write_text("# team keys\ntml-from-file  # alice\n")
    keys = load_keys(str(f), env="tml-from-env")
    assert keys == ["tml-from-env", "tml-from-file"]
    k = Keys(keys)
    assert k.check("tml-from-file") == owner_id("tml-from-file")
    assert k.check("Bearer tml-from-env") == owner_id("tml-from-env")
    for bad in (None, "", "tml-unknown"):
        with pytest.raises(AuthError):
            k.check(bad)


def test_rows_are_private_to_their_key_and_survive_a_restart(tmp_path):
    check_rows_private_and_restart(f"sqlite:///{tmp_path / 'serve.db'}")


def check_rows_private_and_restart(url: str) -> None:
    """The store's contract on an empty database at `url` (tests/test_tinker_postgres.py runs it on
    PostgreSQL): rows scoped per key, results kept and pending futures failed across a restart."""
    store = Store(url)
    a, b = owner_id("tml-a"), owner_id("tml-b")
    sid = store.add_session(a, "0.38.0")
    mid = store.add_model(a, sid, "tiny", 4, "{}")
    done = store.add_future(a, mid, "optim_step")
    store.finish_future(done, result=b'{"metrics": {}}', content_type="application/json")
    pending = store.add_future(a, mid, "forward_backward")
    big = 5 * 2 ** 30  # a state checkpoint of a large adapter: past a 32-bit column
    store.add_checkpoint(a, f"tinker://{mid}/sampler_weights/x", mid, "sampler", "x", "/tmp/x", size_bytes=big)
    sampler = store.add_sampling_session(a, f"tinker://{mid}/sampler_weights/x", "tiny")
    assert store.session(b, sid) is None and not store.heartbeat(b, sid)
    assert store.model(b, mid) is None and store.future(b, done) is None
    assert store.checkpoint(b, f"tinker://{mid}/sampler_weights/x") is None
    assert store.sampling_session(b, sampler) is None and store.list_checkpoints(b) == []

    restarted = Store(url)
    assert restarted.fail_pending("stopped") == 1
    result = restarted.future(a, done)["result"]
    assert type(result) is bytes and result == b'{"metrics": {}}'  # bytes, as the route sends them
    row = restarted.future(a, pending)
    assert (row["status"], row["error"], row["category"]) == ("failed", "stopped", "server")
    assert [(c["name"], c["size_bytes"]) for c in restarted.list_checkpoints(a, mid)] == [("x", big)]
