"""Speculative decoding (prompt lookup) against plain decoding, in one process on the default model.

    python -m bench.speculative --rounds 3 --num-seqs 1 16 --new-tokens 128

Two workloads: ``grounded`` (the answer repeats text of the prompt: fixing the typos of a paragraph,
adding type hints to code, quoting a passage; chat-templated, greedy) and ``random`` (bench.datasets'
random prompts, as bench/compare_servers.sh draws them, EOS ignored). At ``--num-seqs 1`` the prompts run one
after another (a single stream); at N, all N at once (the prompts repeated to N). Systems: ``plain`` and
``ngram`` (``--speculative-config`` {"method": "ngram", "num_speculative_tokens": K}); all run inside every
round, in turn, on one loaded engine. Prints each system's median output tokens/s, its ratio to plain, and
the speculating systems' mean acceptance length. ``--systems`` adds ``early_exit`` (the first
``--exit-layers`` layers draft) and ``draft_self`` (the default model as its own draft model: every greedy
draft accepted, each at the cost of the whole model: the ceiling of acceptance, not a speed-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench.datasets import sample_random_requests
from engine.engine import Engine

TYPOS = (
    "Fix the typos in this paragraph and write it out again in full:\n"
    "The comittee met on tuesday to discus the new budjet. After a long debate, the members agred that the "
    "librairy would recieve more funding next year, while the park reconstruction would be postponned until "
    "the spring. The chairman thanked everyone for there patience and adjurned the meeting at nine o'clock."
)
CODE = (
    "Add type hints to this Python code. Keep everything else exactly as it is:\n"
    "def merge_counts(first, second):\n    merged = dict(first)\n    for key, value in second.items():\n"
    "        merged[key] = merged.get(key, 0) + value\n    return merged\n\n\n"
    "def top_items(counts, limit):\n    ordered = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)\n"
    "    return [key for key, _ in ordered[:limit]]\n"
)
PASSAGE = (
    "Read the passage and answer by quoting the sentences that answer the question.\n"
    "Passage: The lighthouse was built in 1871 on the northern cliff. Its lamp burned whale oil until 1904, "
    "when it was replaced by a kerosene lamp. In 1952 the keeper's house was turned into a small museum, "
    "and the light itself was automated in 1968. Today the museum is open every day from May to October.\n"
    "Question: When was the lamp replaced, and when was the light automated?"
)
GROUNDED = (TYPOS, CODE, PASSAGE)


def chat_ids(engine: Engine, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    assert isinstance(ids, list)
    return ids


def workload(
    engine: Engine, name: str, num_seqs: int, new_tokens: int
) -> tuple[list[list[int]], dict[str, Any]]:
    """The prompts (``num_seqs`` of them, at least the workload's own) and their generation options."""
    if name == "grounded":
        base = [chat_ids(engine, t) for t in GROUNDED]
        prompts = [base[i % len(base)] for i in range(max(num_seqs, len(base)))]
        return prompts, {"max_new_tokens": new_tokens, "do_sample": False}
    requests = sample_random_requests(engine.tokenizer, max(num_seqs, 4), 128, new_tokens, seed=num_seqs)
    prompts = [engine.tokenizer.encode(r.prompt) for r in requests]
    return prompts, {"max_new_tokens": new_tokens, "do_sample": False, "ignore_eos": True}


def run(
    engine: Engine,
    prompts: list[list[int]],
    num_seqs: int,
    speculative: dict[str, Any] | None,
    kw: dict[str, Any],
) -> tuple[float, float]:
    """Output tokens/s over the prompts (``num_seqs`` at a time) and the mean acceptance length."""
    manager = engine.init_continuous_batching(speculative_config=speculative)
    manager.start()
    tokens = 0
    start = time.perf_counter()
    try:
        for i in range(0, len(prompts), num_seqs):
            group = prompts[i : i + num_seqs]
            for p in group:
                manager.add_request(p, **kw)
            done = 0
            while done < len(group):
                out = manager.get_result(timeout=600)
                if out is not None and out.is_finished:
                    done += 1
                    tokens += len(out.generated_ids)
        elapsed = time.perf_counter() - start
        stats = manager.stats()
    finally:
        manager.stop(timeout=30)
    drafts = stats.spec_num_drafts
    return tokens / elapsed, (1 + stats.spec_num_accepted_tokens / drafts) if drafts else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--workloads", nargs="+", default=["grounded", "random"], choices=["grounded", "random"]
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--systems", nargs="+", default=["ngram"], choices=["ngram", "early_exit", "draft_self"],
        help="what to run beside plain decoding",
    )  # fmt: skip
    parser.add_argument("--exit-layers", type=int, default=24, help="early_exit: the layers that draft")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained("default", dtype=args.dtype)
    k = args.num_speculative_tokens
    known: dict[str, dict[str, Any] | None] = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k},
        "early_exit": {"method": "early_exit", "num_layers": args.exit_layers, "num_speculative_tokens": k},
        # the target drafting for itself: every greedy draft accepted, at a draft's cost of a whole model
        "draft_self": {"method": "draft_model", "model": "default", "num_speculative_tokens": k},
    }
    systems = {name: known[name] for name in ["plain", *[s for s in args.systems if s != "plain"]]}
    results = []
    for name in args.workloads:
        for num_seqs in args.num_seqs:
            prompts, kw = workload(engine, name, num_seqs, args.new_tokens)
            speeds: dict[str, list[float]] = {s: [] for s in systems}
            lengths: dict[str, list[float]] = {s: [] for s in systems}
            for _ in range(args.rounds):
                for system, config in systems.items():
                    speed, length = run(engine, prompts, num_seqs, config, kw)
                    speeds[system].append(speed)
                    if config is not None:
                        lengths[system].append(length)
            plain = statistics.median(speeds["plain"])
            for system in systems:
                median = statistics.median(speeds[system])
                row = {
                    "workload": name,
                    "num_seqs": num_seqs,
                    "system": system,
                    "tok_s": round(median, 1),
                    "ratio": round(median / plain, 3),
                    "runs": [round(v, 1) for v in speeds[system]],
                }
                if systems[system] is not None:
                    row["mean_acceptance_length"] = round(statistics.median(lengths[system]), 2)
                results.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
