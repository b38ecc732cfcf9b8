"""Is a free-form answer to a math problem right? The final answer is taken from the text and
compared with the gold answer by value, not as a string.

    answer_correct("... so she has 12 apples left. Answer: 12", 12)        # True
    answer_correct("The answer is \\boxed{\\frac{1}{2}}", "0.5")              # True

The final answer is the content of the last \\boxed{...}, else what follows the last
"answer:" / "answer is" / "####", else the last number of the text. Plain numbers on both
sides (integers, 1,000-style thousands, decimals, a/b, \\frac{a}{b}) are compared exactly
as fractions, here: math-verify takes milliseconds per call and imports sympy. Anything
else (expressions, LaTeX) goes to math-verify.

math-verify bounds its parsing and comparison with SIGALRM, which Python allows only in
the main thread (elsewhere it raises ValueError). So in the main thread, as in a worker of
tools.pool.WorkerPool, its own timeout runs; from any other thread the comparison runs in
a child process, killed when it has not answered after its three timeouts (two parses,
one comparison) and a second. A timeout counts as wrong.
"""
from __future__ import annotations

import math
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from fractions import Fraction

MAX_NUMBER_CHARS = 60
"""A "plain number" longer than this goes to math-verify (its timeout bounds it) instead of
an unbounded exact conversion here."""

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_PLAIN = re.compile(rf"\s*(?P<n>{_NUMBER})(?:\s*/\s*(?P<d>{_NUMBER}))?\s*")
_FRAC = re.compile(r"\s*(?P<s>-?)\s*\\[dt]?frac\s*\{\s*(?P<n>[^{}]*)\}\s*\{\s*(?P<d>[^{}]*)\}\s*")
_MARKER = re.compile(r"(?:answer\s*(?:is|:|=)|####)\s*:?", re.I)
_LAST_NUMBER = re.compile(rf"(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?")
_TRIM = " \t\n.,;:!$"
_UNITS = re.compile(r"^(?P<num>\S+?)\s*(?:%|\\%|[a-zA-Z][a-zA-Z ]*)?$")


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1] if depth == 0 else None


def extract_answer(text: str, require_marker: bool = False) -> str | None:
    """The final answer of free-form text, as text (see the module docstring). With
    `require_marker` only a \\boxed{} or an answer marker counts, never a stray last number."""
    found = boxed(text)
    if found is not None:
        return found.strip()
    markers = list(_MARKER.finditer(text))
    if markers:
        rest = text[markers[-1].end():].strip().split("\n", 1)[0].strip(_TRIM)
        if rest:
            return rest
    numbers = [] if require_marker else _LAST_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def plain_number(text: str) -> Fraction | None:
    """The exact value of a plain number (see the module docstring), else None."""
    text = text.strip().strip("$").strip()
    if len(text) > MAX_NUMBER_CHARS:
        return None
    m = _FRAC.fullmatch(text)
    if m:
        num, den = plain_number(m["n"]), plain_number(m["d"])
        if num is None or den is None or den == 0:
            return None
        return -num / den if m["s"] else num / den
    m = _PLAIN.fullmatch(text)
    if not m:
        return None
    num = Fraction(m["n"].replace(",", ""))
    if m["d"] is None:
        return num
    den = Fraction(m["d"].replace(",", ""))
    return None if den == 0 else num / den


def number_with_unit(text: str) -> Fraction | None:
    """'12 dollars', '45%', '3 apples' -> the number; None when more than one token is numeric."""
    m = _UNITS.fullmatch(text.strip())
    return plain_number(m["num"]) if m else None


def _gold_value(gold) -> Fraction | None:
    if isinstance(gold, bool):
        return None
    if isinstance(gold, int):
        return Fraction(gold)
    if isinstance(gold, float):
        return Fraction(gold).limit_denominator(10**9) if math.isfinite(gold) else None
    return plain_number(str(gold))


def answer_correct(prediction_text: str, gold, timeout_s: float = 5.0, require_marker: bool = False) -> bool:
    """Whether the final answer of `prediction_text` equals `gold` (a number or LaTeX/text).
    `require_marker`: a reply without \\boxed{} or an answer marker is wrong (a reward
    that cannot be earned by a reply cut off after restating the question's numbers)."""
    answer = extract_answer(prediction_text or "", require_marker)
    if answer is None:
        return False
    want = _gold_value(gold)
    if want is not None:
        got = plain_number(answer)
        if got is None:
            got = number_with_unit(answer)
        if got is not None:
            return got == want
    return verify_text(answer, str(gold), timeout_s)


# ---------------------------------------------------------------------------------------
# math-verify, bounded in time from any thread
# ---------------------------------------------------------------------------------------
def _math_verify(answer: str, gold: str, timeout_s: int | None) -> bool:
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException
    try:
        g = parse(f"${gold}$", parsing_timeout=timeout_s)
        p = parse(f"${answer}$", parsing_timeout=timeout_s)
        return bool(g and p and verify(g, p, timeout_seconds=timeout_s))
    except TimeoutException:
        return False


_child: ProcessPoolExecutor | None = None
_child_lock = threading.Lock()
CHILD_START_S = 120.0
"""How long a new child may take to start and import math-verify (sympy) on a loaded node."""


def _warm() -> bool:
    import math_verify  # noqa: F401
    return True


def _kill(child: ProcessPoolExecutor) -> None:
    """End a child that may be stuck (shutdown alone would wait for it; Python < 3.14 has no
    kill_workers, the processes are only reachable through the private _processes)."""
    global _child
    with _child_lock:
        if _child is child:
            _child = None
    for p in list((getattr(child, "_processes", None) or {}).values()):
        p.kill()
    child.shutdown(wait=False, cancel_futures=True)


def _started_child() -> ProcessPoolExecutor:
    global _child
    import multiprocessing
    with _child_lock:
        if _child is not None:
            return _child
        # forkserver: the child does not inherit this process's threads or their locks
        _child = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"))
        child = _child
    try:
        child.submit(_warm).result(timeout=CHILD_START_S)
    except FutureTimeout:
        _kill(child)
        raise
    return child


def _in_child(answer: str, gold: str, timeout_s: float) -> bool:
    """math-verify in a child process (its main thread: its own timeouts work there), the
    child killed when it has not answered after the three timeouts it may use (two parses
    and a comparison) and a second: a loop in C ignores SIGALRM."""
    try:
        child = _started_child()
    except FutureTimeout:
        return False
    future = child.submit(_math_verify, answer, gold, max(1, math.ceil(timeout_s)))
    try:
        return future.result(timeout=3 * max(1, math.ceil(timeout_s)) + 1.0)
    except FutureTimeout:
        _kill(child)
        return False


def verify_text(answer: str, gold: str, timeout_s: float = 5.0) -> bool:
    """math-verify's equivalence of two answers (LaTeX or plain), False after timeout_s."""
    if threading.current_thread() is threading.main_thread():
        return _math_verify(answer, gold, max(1, math.ceil(timeout_s)))
    return _in_child(answer, gold, timeout_s)
