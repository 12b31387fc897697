"""`search`: BM25 search (the `bm25s` package, numpy backend) over a local JSONL corpus.

A corpus is a JSONL file, one document a line: {"id": ..., "title": ..., "text": ...}. The tool
returns the top-k documents for a query, numbered, each as its title and a snippet of at most
`max_chars` characters (the sentences that share the most words with the query):

    tools: [{name: search, args: {corpus: data/search/corpus.jsonl, top_k: 3}}]

Without `corpus`, the tool takes the sample's `metadata["corpus"]`; a relative path there counts
from the directory of the shard the sample came from, so a built dataset can be moved as a whole.

A tool is built per trajectory (thousands per run), so the index is built once per corpus file
per process (`load_index`: cached by path, mtime and size, rebuilt when the file changes) and
shared read-only by every instance and thread.

The module also makes a synthetic corpus of fictional cities (`write_corpus`) and questions
that only a search can answer (`make_questions`: "What colour is the flag of Varn?" -> "green"),
and `build_dataset` writes both as a dataset recipe's shards (`{split}-%06d.tar` +
dataset.json + corpus.jsonl).
"""
from __future__ import annotations

import json
import os
import re
import threading
from typing import Any

import numpy as np

from mmrl.registry import register
from mmrl.tools.base import Tool, ToolError

_TOKEN = re.compile(r"(?u)\b\w\w+\b")  # bm25s.tokenize's default pattern: snippets match the index


def _tokenize(texts: list[str]) -> list[list[str]]:
    # bm25s is imported on first use: it imports numba when installed (seconds), and importing
    # mmrl.tools (every run) registers this tool
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


def read_corpus(path: str) -> list[dict[str, Any]]:
    """The documents of a JSONL corpus: dicts with "id", "title", "text" (title/id may be
    missing: "" and the line number)."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise ValueError(f"{path}:{n}: a document must be an object with a string 'text'")
            docs.append({"id": str(doc.get("id", n)), "title": str(doc.get("title") or ""), "text": doc["text"]})
    if not docs:
        raise ValueError(f"{path}: the corpus has no documents")
    return docs


class CorpusIndex:
    """A BM25 index over `docs`; `search` only reads it, so threads may share one."""

    def __init__(self, docs: list[dict[str, Any]]):
        import bm25s

        self.docs = docs
        self.retriever = bm25s.BM25()  # numpy backend, Lucene scoring, k1=1.5, b=0.75
        self.retriever.index(_tokenize([f"{d['title']} {d['text']}" for d in docs]), show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[dict[str, Any], float]]:
        """The up to `k` documents sharing a word with the query, best first (ties: corpus order)."""
        ids = self.retriever.get_tokens_ids(_tokenize([query])[0])
        if not ids:  # no query word is in the corpus (get_scores needs at least one)
            return []
        scores = self.retriever.get_scores_from_ids(ids)
        order = np.argsort(-scores, kind="stable")[:k]
        return [(self.docs[i], float(scores[i])) for i in order if scores[i] > 0]


_CACHE: dict[str, tuple[tuple[int, int], CorpusIndex]] = {}
_CACHE_LOCK = threading.Lock()  # one build per file even when many trajectories start at once


def load_index(path: str) -> CorpusIndex:
    """The index of the corpus at `path`, built on first use and again when the file changes."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = (st.st_mtime_ns, st.st_size)
    with _CACHE_LOCK:
        hit = _CACHE.get(real)
        if hit is None or hit[0] != stamp:
            hit = _CACHE[real] = (stamp, CorpusIndex(read_corpus(real)))  # replaces the stale one
        return hit[1]


def snippet(text: str, query: str, max_chars: int) -> str:
    """At most `max_chars` of `text`: the whole text when it fits, else the sentences with the
    most query words (in text order, gaps marked "..."), so the matching fact is what is shown."""
    if len(text) <= max_chars:
        return text
    words = set(_TOKEN.findall(query.lower()))
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    hits = [len(words & set(_TOKEN.findall(s.lower()))) for s in sentences]
    chosen: list[int] = []
    used = 0
    # sentences without a query word only when none has one (then: the text's first sentences)
    candidates = [i for i in range(len(sentences)) if hits[i]] or range(len(sentences))
    for i in sorted(candidates, key=lambda i: (-hits[i], i)):
        cost = len(sentences[i]) + (5 if chosen else 0)  # + 5: the " ... " that may join it
        if used + cost <= max_chars:
            chosen.append(i)
            used += cost
    if not chosen:  # the best sentence alone is too long: cut it at a word boundary
        best = sentences[min(range(len(sentences)), key=lambda i: (-hits[i], i))]
        return best[:max_chars - 3].rsplit(" ", 1)[0] + "..."
    chosen.sort()
    parts = [sentences[chosen[0]]]
    for prev, i in zip(chosen, chosen[1:]):
        parts.append((" " if i == prev + 1 else " ... ") + sentences[i])
    return "".join(parts)


def _sample_corpus(sample: Any) -> str | None:
    """The sample's metadata["corpus"], a relative path counted from its shard's directory."""
    path = (getattr(sample, "metadata", None) or {}).get("corpus")
    if not path or os.path.isabs(path):
        return path
    source = str(getattr(sample, "source", "") or "").removeprefix("file://")
    if source and ":" not in source.split("/")[0]:  # a local shard, not pipe:/http: ...
        return os.path.join(os.path.dirname(source), path)
    return path


@register("tool", "search")
class SearchTool(Tool):
    """BM25 search over a local corpus; see the module docstring."""

    name = "search"
    description = "Search the document collection; returns the best matching documents (title and excerpt)."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "words to search for"}},
        "required": ["query"],
    }

    def __init__(self, sample: Any = None, corpus: str | None = None, top_k: int = 3, max_chars: int = 300):
        super().__init__(sample)
        path = corpus or _sample_corpus(sample)
        if not path:
            raise ValueError("search: give args.corpus (a JSONL file) or a sample with metadata['corpus']")
        if int(top_k) < 1 or int(max_chars) < 20:
            raise ValueError(f"search: top_k must be >= 1 and max_chars >= 20, got {top_k}, {max_chars}")
        self.top_k, self.max_chars = int(top_k), int(max_chars)
        self.index = load_index(path)  # a missing or broken corpus fails here, before any call
        self.calls = 0

    def call(self, function: str, arguments: dict[str, Any]) -> str:
        if function != self.name:
            raise ToolError(f"unknown function {function!r}; call {self.name!r}")
        extra = set(arguments) - {"query"}
        if extra:
            raise ToolError(f"unknown argument(s) {', '.join(sorted(extra))}; search takes only 'query'")
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ToolError("query must be a non-empty string, e.g. {\"query\": \"flag of Varn\"}")
        self.calls += 1
        found = self.index.search(query, self.top_k)
        if not found:
            return "no results"
        return "\n\n".join(f"[{n}] {doc['title']}\n{snippet(doc['text'], query, self.max_chars)}"
                           for n, (doc, _) in enumerate(found, 1))

    def state(self) -> dict[str, Any]:
        return {"search_calls": self.calls}


# ------------------------------------------------------------------------- synthetic corpus

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "k", "th", "m")
_FLAG_COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black")
_EXPORTS = ("copper", "salt", "wool", "timber", "glass", "silk", "wine", "tin", "amber", "pepper", "cheese", "paper")
# attribute -> the question about a city (each names the city and the fact's own words, so BM25
# finds the city's document and the snippet picks the sentence that holds the answer)
QUESTIONS = {
    "flag": "What colour is the flag of {city}?",
    "river": "Which river flows through {city}?",
    "founder": "Who founded {city}?",
    "year": "In which year was {city} founded?",
    "export": "What is the main export of {city}?",
    "population": "What is the population of {city}?",
}
_FACTS = ("city", "province", "river", "population", "flag", "founder", "year", "export")


def _names(rng: np.random.Generator, n: int, taken: set[str]) -> list[str]:
    """`n` new made-up words of 2-3 syllables, none in `taken` (which they are added to): each
    name is then a token of exactly the documents that mention it."""
    out = []
    while len(out) < n:
        word = "".join(_ONSETS[rng.integers(len(_ONSETS))] + _VOWELS[rng.integers(len(_VOWELS))]
                       for _ in range(int(rng.integers(2, 4)))) + _CODAS[rng.integers(len(_CODAS))]
        if word not in taken:
            taken.add(word)
            out.append(word.capitalize())
    return out


def make_cities(seed: int, n_docs: int) -> list[dict[str, Any]]:
    """`n_docs` fictional cities with their facts, a pure function of (seed, n_docs)."""
    if n_docs < 1:
        raise ValueError(f"n_docs must be >= 1, got {n_docs}")
    rng = np.random.default_rng([seed, 0x5EA2C4])
    # made-up names never clash with the words of the questions, documents or answers
    template = " ".join([*QUESTIONS.values(), city_document(dict.fromkeys((*_FACTS, "id"), ""))["text"],
                         *_FLAG_COLOURS, *_EXPORTS])
    taken = set(_TOKEN.findall(template.lower()))
    names, rivers, provinces = (_names(rng, n_docs, taken) for _ in range(3))
    firsts, lasts = _names(rng, n_docs, taken), _names(rng, n_docs, taken)
    return [{"id": f"city-{i:04d}", "city": names[i], "province": provinces[i], "river": rivers[i],
             "population": str(int(rng.integers(2_000, 900_000))),
             "flag": _FLAG_COLOURS[rng.integers(len(_FLAG_COLOURS))],
             "founder": f"{firsts[i]} {lasts[i]}", "year": str(int(rng.integers(800, 1900))),
             "export": _EXPORTS[rng.integers(len(_EXPORTS))]} for i in range(n_docs)]


def city_document(c: dict[str, Any]) -> dict[str, str]:
    name = c["city"]
    text = (f"{name} is a city in the province of {c['province']}, with a population of {c['population']}. "
            f"The river {c['river']} flows through {name}. The flag of {name} is {c['flag']}. "
            f"{name} was founded in {c['year']} by {c['founder']}. The main export of {name} is {c['export']}.")
    return {"id": c["id"], "title": name, "text": text}


def write_corpus(path: str, seed: int = 0, n_docs: int = 200) -> list[dict[str, str]]:
    """Write the synthetic corpus (one city a document) to `path` as JSONL; return its documents."""
    docs = [city_document(c) for c in make_cities(seed, n_docs)]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d, sort_keys=True) + "\n" for d in docs)
    return docs


def make_questions(seed: int = 0, n_docs: int = 200) -> list[dict[str, str]]:
    """Every (city, attribute) question about the corpus `write_corpus(_, seed, n_docs)` writes,
    shuffled with the seed: {"question", "answer", "doc_id", "attribute"}. Each answer is a fact
    of one made-up city, so it can only be known by searching."""
    qs = [{"question": QUESTIONS[a].format(city=c["city"]), "answer": c[a], "doc_id": c["id"], "attribute": a}
          for c in make_cities(seed, n_docs) for a in QUESTIONS]
    order = np.random.default_rng([seed, 0x9E57]).permutation(len(qs))
    return [qs[i] for i in order]


PROMPT_SUFFIX = " Use the search tool to find out, then give the answer alone."


def build_dataset(out_dir: str, *, train_size: int = 1024, heldout_size: int = 128, n_docs: int = 200,
                  shard_size: int = 1024, seed: int = 0) -> dict[str, Any]:
    """A dataset recipe (`build(out_dir, **options) -> manifest`): DIR/corpus.jsonl and train /
    held-out shards of distinct questions whose metadata["corpus"] is "corpus.jsonl"."""
    from mmrl.plugins.data.recipes._common import (SPLITS, ShardSink, brace, check_sizes, clean_out_dir,
                                           record_bytes, write_manifest)

    check_sizes(train_size, heldout_size, shard_size)
    qs = make_questions(seed, n_docs)
    if train_size + heldout_size > len(qs):
        raise ValueError(f"{n_docs} documents make {len(qs)} questions, fewer than train_size + heldout_size; "
                         f"raise n_docs")
    out_dir = clean_out_dir(out_dir)
    write_corpus(os.path.join(out_dir, "corpus.jsonl"), seed, n_docs)
    counts, shards, n_shards, start = {}, {}, {}, 0
    for split, n in zip(SPLITS, (train_size, heldout_size)):
        if n == 0:
            continue
        with ShardSink(os.path.join(out_dir, f"{split}-%06d.tar"), maxcount=shard_size) as sink:
            for i, q in enumerate(qs[start:start + n]):  # the splits take disjoint questions
                meta = {"split": split, "index": i, "corpus": "corpus.jsonl", "doc_id": q["doc_id"],
                        "attribute": q["attribute"]}
                rec = {"prompt": q["question"] + PROMPT_SUFFIX, "answer": q["answer"], "metadata": meta}
                sink.write({"__key__": f"{split}-{i:06d}", "json": record_bytes(rec)})
        start += n
        counts[split], n_shards[split], shards[split] = n, len(sink.shards), brace(split, len(sink.shards))
    info = {"recipe": "search_qa", "args": {"train_size": train_size, "heldout_size": heldout_size,
                                            "n_docs": n_docs, "shard_size": shard_size, "seed": seed},
            "counts": counts, "num_shards": n_shards, "shards": shards, "corpus": "corpus.jsonl", "tool": "search"}
    write_manifest(out_dir, info)
    return info
