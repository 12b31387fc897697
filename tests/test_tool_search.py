"""The `search` tool: real bm25s indexes over JSONL corpora in tmp_path, calls through `run_tool`,
the per-process index cache, and the synthetic city corpus / questions / dataset recipe."""
from __future__ import annotations

import asyncio
import json
import os
import re
import threading

import pytest

from mmrl.data.sample import Sample
from mmrl.registry import resolve
from mmrl.tools import run_tool
from mmrl.tools.search import (QUESTIONS, SearchTool, build_dataset, load_index, make_questions,
                               snippet, write_corpus)

DOCS = [
    {"id": "a", "title": "Varn", "text": "Varn is a harbour town. The flag of Varn is green."},
    {"id": "b", "title": "Osk", "text": "Osk is a mountain town. The flag of Osk is red."},
    {"id": "c", "title": "Rivers", "text": "Rivers of the north flow into the cold sea."},
    {"id": "d", "title": "Towns", "text": "Every town has a flag, and every town has a market."},
]


def write_jsonl(path, docs) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    return str(path)


def results(text: str) -> list[str]:
    """The titles of a search answer, in rank order."""
    return re.findall(r"^\[\d+\] (.*)$", text, flags=re.M)


def call(tool, query) -> tuple[str, bool]:
    result, _ = asyncio.run(run_tool(tool, "search", {"query": query}, 10.0))
    return result.text, result.error


@pytest.fixture
def small(tmp_path) -> str:
    return write_jsonl(tmp_path / "small.jsonl", DOCS)


@pytest.fixture(scope="module")
def cities(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("cities") / "corpus.jsonl")
    write_corpus(path, seed=3, n_docs=40)
    return path


def test_registered_with_one_function(small):
    assert resolve("tool", "search") is SearchTool
    tool = SearchTool(None, corpus=small)
    [fn] = tool.functions()
    assert fn["function"]["name"] == "search" and fn["function"]["parameters"]["required"] == ["query"]


def test_the_document_with_the_fact_ranks_first(small):
    tool = SearchTool(None, corpus=small)
    text, error = call(tool, "What colour is the flag of Varn?")
    assert not error
    assert results(text)[0] == "Varn"
    assert text.startswith("[1] Varn\nVarn is a harbour town. The flag of Varn is green.")
    assert results(call(tool, "mountain")[0]) == ["Osk"]
    assert tool.state() == {"search_calls": 2}


def test_top_k_limits_the_results(small, cities):
    # "flag" is in three of the four small documents, "city" in all forty city documents
    assert len(results(call(SearchTool(None, corpus=small), "flag")[0])) == 3
    assert len(results(call(SearchTool(None, corpus=small, top_k=1), "flag")[0])) == 1
    assert len(results(call(SearchTool(None, corpus=cities), "city")[0])) == 3
    assert len(results(call(SearchTool(None, corpus=cities, top_k=7), "city")[0])) == 7


def test_bad_calls_are_tool_errors_and_misses_say_no_results(small):
    tool = SearchTool(None, corpus=small)
    for query in ("", "   ", None, 3):
        text, error = call(tool, query)
        assert error and text.startswith("error: query must be a non-empty string"), query
    result, _ = asyncio.run(run_tool(tool, "search", {"query": "Varn", "k": 2}, 10.0))
    assert result.error and "unknown argument(s) k" in result.text
    assert call(tool, "zebra quasar") == ("no results", False)
    assert call(tool, "the of and") == ("no results", False)  # only stopwords
    assert tool.state() == {"search_calls": 2}  # refused calls do not count
    with pytest.raises(ValueError, match="metadata"):
        SearchTool(None)
    with pytest.raises(FileNotFoundError):
        SearchTool(None, corpus=small + ".missing")


def test_index_is_cached_per_file_and_rebuilt_when_it_changes(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", DOCS)
    a, b = SearchTool(None, corpus=path), SearchTool(None, corpus=path, top_k=1)
    assert a.index is b.index is load_index(path)
    assert load_index(write_jsonl(tmp_path / "copy.jsonl", DOCS)) is not a.index  # another file
    write_jsonl(path, DOCS + [{"id": "e", "title": "Quill", "text": "Quill is a new town."}])
    os.utime(path, ns=(1, 1))  # a different mtime even on a coarse-grained filesystem
    c = SearchTool(None, corpus=path)
    assert c.index is not a.index and len(c.index.docs) == 5
    assert results(call(c, "Quill")[0]) == ["Quill"]
    assert call(a, "Quill")[0] == "no results"  # a trajectory keeps the index it started with
    assert SearchTool(None, corpus=path).index is c.index


def test_threads_share_one_index_and_agree(cities):
    questions = [q["question"] for q in make_questions(seed=3, n_docs=40)][:24]
    fresh = os.path.join(os.path.dirname(cities), "threads.jsonl")
    write_corpus(fresh, seed=3, n_docs=40)  # a path no test has indexed yet: the threads race to build it
    serial = [SearchTool(None, corpus=cities).call("search", {"query": q}) for q in questions]
    out: dict[int, tuple] = {}

    def work(i: int) -> None:
        tool = SearchTool(None, corpus=fresh)
        out[i] = (tool.index, [tool.call("search", {"query": q}) for q in questions])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(index) for index, _ in out.values()}) == 1
    assert all(answers == serial for _, answers in out.values())


def test_snippet_keeps_the_matching_sentences_within_max_chars():
    text = ("Alpha is first. Beta comes next in line. The flag of Varn is green. "
            "Gamma is filler text here. The river of Varn is wide.")
    assert snippet(text, "anything", len(text)) == text
    s = snippet(text, "flag of Varn", 57)
    assert s == "The flag of Varn is green. ... The river of Varn is wide." and len(s) <= 57
    assert snippet(text, "flag of Varn", 56) == "The flag of Varn is green."  # nothing unrelated fills up
    assert snippet(text, "zebra", 50) == "Alpha is first. Beta comes next in line."
    s = snippet(text, "flag Varn", 30)
    assert s == "The flag of Varn is green." and len(s) <= 30
    long = "word " * 40 + "varn."
    s = snippet(long, "varn", 50)
    assert len(s) <= 50 and s.endswith("...")


def test_corpus_and_questions_are_deterministic_per_seed(tmp_path):
    docs = write_corpus(str(tmp_path / "a.jsonl"), seed=3, n_docs=40)
    write_corpus(str(tmp_path / "b.jsonl"), seed=3, n_docs=40)
    write_corpus(str(tmp_path / "c.jsonl"), seed=4, n_docs=40)
    a, b, c = ((tmp_path / f"{x}.jsonl").read_bytes() for x in "abc")
    assert a == b and a != c
    assert len(docs) == 40 and len({d["title"] for d in docs}) == 40
    assert [json.loads(line) for line in a.decode().splitlines()] == docs
    qs = make_questions(seed=3, n_docs=40)
    assert qs == make_questions(seed=3, n_docs=40) and qs != make_questions(seed=4, n_docs=40)
    assert len(qs) == 40 * len(QUESTIONS) and len({q["question"] for q in qs}) == len(qs)
    by_id = {d["id"]: d for d in docs}
    for q in qs:  # the answer is a fact of the named city's document
        doc = by_id[q["doc_id"]]
        assert doc["title"] in q["question"] and q["answer"] in doc["text"]


@pytest.mark.parametrize("max_chars", [300, 120])
def test_every_question_is_answered_by_the_top_result(cities, max_chars):
    docs = {d["id"]: d for d in map(json.loads, open(cities))}
    tool = SearchTool(None, corpus=cities, max_chars=max_chars)
    for q in make_questions(seed=3, n_docs=40):
        text = tool.call("search", {"query": q["question"]})
        top = text.split("\n\n")[0]
        assert top.startswith(f"[1] {docs[q['doc_id']]['title']}\n"), (q, text)
        assert q["answer"] in top, (q, text)
        assert all(len(block.split("\n", 1)[1]) <= max_chars for block in text.split("\n\n"))


def test_dataset_samples_find_their_corpus_through_the_shard(tmp_path):
    from mmrl.data.stream import load_all

    info = build_dataset(str(tmp_path / "ds"), train_size=30, heldout_size=10, n_docs=10, shard_size=16, seed=1)
    assert info["counts"] == {"train": 30, "heldout": 10} and info["num_shards"] == {"train": 2, "heldout": 1}
    assert json.loads((tmp_path / "ds" / "dataset.json").read_text()) == info
    with pytest.raises(ValueError, match="raise n_docs"):
        build_dataset(str(tmp_path / "small"), train_size=50, heldout_size=11, n_docs=10)
    train = load_all(os.path.join(tmp_path / "ds", info["shards"]["train"]))
    held = load_all(os.path.join(tmp_path / "ds", info["shards"]["heldout"]))
    assert len(train) == 30 and len(held) == 10
    assert not {s.prompt_text for s in train} & {s.prompt_text for s in held}
    for s in held:
        assert s.metadata["corpus"] == "corpus.jsonl" and not s.images
        tool = SearchTool(s)  # the relative path counts from the shard's directory
        assert tool.index is load_index(str(tmp_path / "ds" / "corpus.jsonl"))
        question = s.prompt_text.split("?")[0] + "?"
        assert s.answer in tool.call("search", {"query": question}).split("\n\n")[0]
    # rebuilt with the same seed: byte-identical shards and corpus
    build_dataset(str(tmp_path / "again"), train_size=30, heldout_size=10, n_docs=10, shard_size=16, seed=1)
    for name in ("corpus.jsonl", "train-000000.tar", "train-000001.tar", "heldout-000000.tar"):
        assert (tmp_path / "ds" / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_sample_corpus_path_absolute_and_relative_to_cwd(small, tmp_path, monkeypatch):
    assert SearchTool(Sample(key="k", messages=[], metadata={"corpus": small})).index is load_index(small)
    monkeypatch.chdir(tmp_path)
    tool = SearchTool(Sample(key="k", messages=[], metadata={"corpus": "small.jsonl"}))  # no shard: the cwd
    assert results(tool.call("search", {"query": "Osk"}))[0] == "Osk"
    assert SearchTool(Sample(key="k", messages=[], metadata={"corpus": "x.jsonl"}), corpus=small).index \
        is load_index(small)  # args.corpus wins
