"""bench/spec_bench.py's copy oracle: the bound that the engine's draft step counts compare with."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from spec_bench import copy_oracle  # noqa: E402


def test_copies_the_longest_run_present_in_the_context():
    # First token from the prefill; then "2 3" is in the prompt, "2 3 4" is not: one step
    # drafts 2 and 3 and emits 4 after them.
    r = copy_oracle([1, 2, 3], [1, 2, 3, 4], 7)
    assert (r["steps"], r["draft_tokens"]) == (2, 2)


def test_nothing_to_copy_means_one_token_per_step():
    r = copy_oracle([1, 2, 3], [7, 8, 9, 10], 7)
    assert (r["steps"], r["draft_tokens"], r["tokens_per_step"]) == (4, 0, 1.0)


def test_draft_length_is_capped():
    prompt = list(range(100))
    r = copy_oracle(prompt, list(range(20)), 4)  # the whole output is in the prompt
    # 1 + 19 tokens in runs of 5 (4 drafted + 1): 4 steps after the first
    assert (r["steps"], r["draft_tokens"]) == (5, 15)


def test_output_copying_itself_counts():
    # 5 (prefill) | 6 (nothing to copy) | "5 6" copied from the output so far, then 5 | 6 (last)
    r = copy_oracle([], [5, 6, 5, 6, 5, 6], 7)
    assert (r["steps"], r["draft_tokens"]) == (4, 2)
