"""The reference recipe's bench prompts, verbatim, so fleet numbers compare with the published ones."""

from __future__ import annotations

from typing import NamedTuple

SMOKE_PROMPT = "What is the capital of France? Answer in one word."
SMOKE_MAX_TOKENS = 8
SMOKE_EXPECT = "paris"

# The decode bank of the reference recipe's run_bank.sh: acceptance is task-dependent (prose ~2.3,
# code ~5.4, counting ~11 with DFlash n=12), so one number per workload.
DECODE_BANK: dict[str, str] = {
    "prose": (
        "You are a careful writer. Write a long flowing essay about the history and "
        "philosophy of science, with no lists. Begin: "
    ),
    "code": (
        "Write a complete Python implementation of a binary search tree class with insert, "
        "search, delete, and inorder traversal. Include docstrings and type hints. "
        "Begin:\n\nclass BSTNode:"
    ),
    "counting": (
        "Write all the whole numbers from 1 to 400, separated by commas, with no other "
        "text. Begin: 1, 2, 3, "
    ),
}


def decode_workloads(user_prompt: str | None) -> dict[str, str]:
    """The bank, plus the user's own prompt as workload ``user`` when one is given."""
    bank = dict(DECODE_BANK)
    if user_prompt:
        bank["user"] = user_prompt
    return bank


class E2EPrompt(NamedTuple):
    name: str
    prompt: str
    max_tokens: int


# albond's five prompts (bench_qwen35.sh, reproduced by the reference recipe's bench_albond.py).
ALBOND_PROMPTS: list[E2EPrompt] = [
    E2EPrompt("Q&A", "What are the main differences between TCP and UDP? Be concise.", 256),
    E2EPrompt(
        "Code",
        "Write a Python function that implements binary search on a sorted list. Include "
        "type hints and docstring.",
        512,
    ),
    E2EPrompt(
        "JSON",
        "Generate a JSON array of 10 fictional employees with fields: name, age, department, "
        "salary, email, skills (array of 3). Output ONLY valid JSON, no explanation.",
        1024,
    ),
    E2EPrompt("Math", "What is 7823 * 4519? Show only the answer.", 64),
    E2EPrompt(
        "LongCode",
        "Write a complete Python implementation of a red-black tree with insert, delete, "
        "search, and in-order traversal. Include all rotation methods.",
        2048,
    ),
]
# albond discards pass 1 as JIT warm-up and reports pass 2.
ALBOND_PASSES = 2
