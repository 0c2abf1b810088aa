"""The built-in code task suite: small Python functions, generated from templates.

Owns the templates and the generator `builtin_tasks(split, seed, n)`. Each template is a
one-line description, a reference solution and an input generator; a task is a template with
a function name, argument names and constants drawn from it, and its tests are asserts whose
expected values come from running the reference solution here (trusted code), so tests and
solution cannot disagree. Prompts are short and give the signature and one example, so that
a tiny instruct model (SmolLM2-135M-Instruct) solves some of them: learning needs signal.

Splits: `train` and `test` use disjoint templates (see `TRAIN_TEMPLATES` / `TEST_TEMPLATES`):
the held-out set measures transfer to operations never trained on, in the same families
(arithmetic, conditionals, strings, lists). Generation is deterministic for a given seed
(`random.Random` seeded with a string, independent of PYTHONHASHSEED).

Does not own: scoring, or loading other task sources.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from .task import CODE_BLOCK_INSTRUCTION, CodeTask

DEFAULT_TRAIN = 500
DEFAULT_TEST = 128
TESTS_PER_TASK = 4

_INT_ARGS = ("x", "n", "num", "value")
_PAIR_ARGS = (("a", "b"), ("x", "y"), ("m", "n"))
_TRIPLE_ARGS = (("a", "b", "c"), ("x", "y", "z"), ("p", "q", "r"))
_STR_ARGS = ("s", "text", "word")
_LIST_ARGS = ("xs", "nums", "values", "numbers")
_WORDS = ("cat", "level", "banana", "hello", "apple", "noon", "python", "tree", "radar",
          "queue", "abc", "moon", "kayak", "sun", "data", "")
_LABELS = (("big", "small"), ("high", "low"), ("yes", "no"), ("hot", "cold"))
_SUFFIXES = ("!", "ing", "_x", "s", "?")


def _ints(rng: random.Random) -> tuple:
    return (rng.randint(-20, 40),)


def _pairs(rng: random.Random) -> tuple:
    return (rng.randint(-20, 40), rng.randint(-20, 40))


def _triples(rng: random.Random) -> tuple:
    return (rng.randint(-20, 40), rng.randint(-20, 40), rng.randint(-20, 40))


def _words(rng: random.Random) -> tuple:
    return (rng.choice(_WORDS),)


def _lists(rng: random.Random) -> tuple:
    return ([rng.randint(-9, 20) for _ in range(rng.randint(0, 6))],)


def _nonempty_lists(rng: random.Random) -> tuple:
    return ([rng.randint(-9, 20) for _ in range(rng.randint(1, 6))],)


@dataclass(frozen=True)
class Template:
    key: str
    names: tuple[str, ...]
    """Function-name patterns; `{k}` etc. are filled from the parameters."""
    args: tuple[tuple[str, ...], ...]
    """Alternative argument-name tuples."""
    describe: str
    """What the function returns, with `{a0}`, `{a1}` for argument names and parameters."""
    body: str
    """The reference solution's body (one or more lines, unindented)."""
    inputs: Callable[[random.Random], tuple]
    params: dict[str, tuple] | None = None
    """Parameter name -> allowed values; the grid of all combinations is sampled."""


def _one(*args: str) -> tuple[tuple[str, ...], ...]:
    return tuple((a,) for a in args)


TRAIN_TEMPLATES: tuple[Template, ...] = (
    # arithmetic
    Template("add_k", ("add_{k}", "plus_{k}", "increment_by_{k}"), _one(*_INT_ARGS),
             "returns {a0} plus {k}", "return {a0} + {k}", _ints, {"k": tuple(range(2, 21))}),
    Template("sub_k", ("subtract_{k}", "minus_{k}", "decrease_by_{k}"), _one(*_INT_ARGS),
             "returns {a0} minus {k}", "return {a0} - {k}", _ints, {"k": tuple(range(2, 21))}),
    Template("mul_k", ("times_{k}", "multiply_by_{k}", "scale_{k}"), _one(*_INT_ARGS),
             "returns {a0} multiplied by {k}", "return {a0} * {k}", _ints, {"k": tuple(range(2, 13))}),
    Template("affine", ("linear", "affine", "line_value"), _one(*_INT_ARGS),
             "returns {m} times {a0} plus {c}", "return {m} * {a0} + {c}", _ints,
             {"m": tuple(range(2, 7)), "c": tuple(range(1, 10))}),
    Template("square_plus_k", ("square_plus_{k}", "sq_add_{k}"), _one(*_INT_ARGS),
             "returns the square of {a0} plus {k}", "return {a0} * {a0} + {k}", _ints,
             {"k": tuple(range(1, 16))}),
    Template("floor_div_k", ("div_{k}", "floor_div_{k}", "split_{k}"), _one(*_INT_ARGS),
             "returns {a0} divided by {k}, rounded down (integer division)", "return {a0} // {k}",
             _ints, {"k": tuple(range(2, 11))}),
    Template("abs_diff", ("abs_diff", "distance", "gap"), _PAIR_ARGS,
             "returns the absolute difference between {a0} and {a1}", "return abs({a0} - {a1})", _pairs),
    Template("max_two", ("larger", "max_of_two", "bigger"), _PAIR_ARGS,
             "returns the larger of {a0} and {a1}", "return max({a0}, {a1})", _pairs),
    Template("sum_two_times_k", ("sum_times_{k}", "add_then_scale_{k}"), _PAIR_ARGS,
             "returns the sum of {a0} and {a1}, multiplied by {k}", "return ({a0} + {a1}) * {k}",
             _pairs, {"k": tuple(range(2, 10))}),
    # conditionals
    Template("is_multiple", ("is_multiple_of_{k}", "divisible_by_{k}"), _one(*_INT_ARGS),
             "returns True if {a0} is divisible by {k}, otherwise False", "return {a0} % {k} == 0",
             _ints, {"k": tuple(range(2, 8))}),
    Template("clamp", ("clamp", "limit", "bound"), _one(*_INT_ARGS),
             "returns {a0} limited to the range {lo} to {hi} (values below {lo} become {lo}, "
             "values above {hi} become {hi})", "return max({lo}, min({hi}, {a0}))", _ints,
             {"lo": (-10, -5, 0, 1), "hi": (10, 15, 20, 30)}),
    Template("sign_label", ("sign", "sign_name", "describe_sign"), _one(*_INT_ARGS),
             "returns 'positive' if {a0} > 0, 'negative' if {a0} < 0, and 'zero' otherwise",
             "if {a0} > 0:\n    return 'positive'\nif {a0} < 0:\n    return 'negative'\nreturn 'zero'",
             lambda rng: (rng.choice((-7, -1, 0, 0, 3, 12)),)),
    Template("threshold_label", ("classify", "label", "size_of"), _one(*_INT_ARGS),
             "returns '{hi_word}' if {a0} is greater than {k}, otherwise '{lo_word}'",
             "return '{hi_word}' if {a0} > {k} else '{lo_word}'", _ints,
             {"k": (0, 5, 10, 15), "words": _LABELS}),
    Template("is_even", ("is_even", "even", "check_even"), _one(*_INT_ARGS),
             "returns True if {a0} is even, otherwise False", "return {a0} % 2 == 0", _ints),
    # strings
    Template("repeat_k", ("repeat_{k}", "times_text_{k}"), _one(*_STR_ARGS),
             "returns the string {a0} repeated {k} times", "return {a0} * {k}", _words,
             {"k": tuple(range(2, 6))}),
    Template("reverse_str", ("reverse", "reverse_string", "backwards"), _one(*_STR_ARGS),
             "returns the string {a0} reversed", "return {a0}[::-1]", _words),
    Template("count_char", ("count_{c}", "how_many_{c}"), _one(*_STR_ARGS),
             "returns how many times the letter '{c}' appears in the string {a0}",
             "return {a0}.count('{c}')", _words, {"c": tuple("aenoklr")}),
    Template("add_suffix", ("add_suffix", "append_end", "with_suffix"), _one(*_STR_ARGS),
             "returns the string {a0} followed by '{suffix}'", "return {a0} + '{suffix}'", _words,
             {"suffix": _SUFFIXES}),
    Template("first_k", ("first_{k}", "head_{k}", "prefix_{k}"), _one(*_STR_ARGS),
             "returns the first {k} characters of the string {a0}", "return {a0}[:{k}]", _words,
             {"k": tuple(range(2, 5))}),
    Template("to_upper", ("shout", "to_upper", "upper"), _one(*_STR_ARGS),
             "returns the string {a0} in upper case", "return {a0}.upper()", _words),
    # lists
    Template("sum_list", ("total", "sum_list", "add_all"), _one(*_LIST_ARGS),
             "returns the sum of the numbers in the list {a0}", "return sum({a0})", _lists),
    Template("count_greater", ("count_above_{k}", "how_many_over_{k}"), _one(*_LIST_ARGS),
             "returns how many numbers in the list {a0} are greater than {k}",
             "return len([v for v in {a0} if v > {k}])", _lists, {"k": tuple(range(0, 11))}),
    Template("filter_even", ("evens", "only_even", "keep_even"), _one(*_LIST_ARGS),
             "returns a list of the even numbers in the list {a0}, in order",
             "return [v for v in {a0} if v % 2 == 0]", _lists),
    Template("scale_list", ("scale_all_{k}", "multiply_all_{k}"), _one(*_LIST_ARGS),
             "returns a new list with every number in the list {a0} multiplied by {k}",
             "return [v * {k} for v in {a0}]", _lists, {"k": tuple(range(2, 8))}),
    Template("max_list", ("largest", "max_value", "biggest"), _one(*_LIST_ARGS),
             "returns the largest number in the non-empty list {a0}", "return max({a0})", _nonempty_lists),
    Template("first_element", ("first", "head", "first_item"), _one(*_LIST_ARGS),
             "returns the first element of the non-empty list {a0}", "return {a0}[0]", _nonempty_lists),
)

TEST_TEMPLATES: tuple[Template, ...] = (
    Template("mod_k", ("mod_{k}", "remainder_{k}"), _one(*_INT_ARGS),
             "returns the remainder of {a0} divided by {k}", "return {a0} % {k}", _ints,
             {"k": tuple(range(2, 10))}),
    Template("power_k", ("power_{k}", "raise_to_{k}"), _one(*_INT_ARGS),
             "returns {a0} raised to the power {k}", "return {a0} ** {k}", _ints, {"k": (2, 3, 4)}),
    Template("min_two", ("smaller", "min_of_two", "lesser"), _PAIR_ARGS,
             "returns the smaller of {a0} and {a1}", "return min({a0}, {a1})", _pairs),
    Template("in_range", ("in_range", "between", "is_inside"), _one(*_INT_ARGS),
             "returns True if {a0} is between {lo} and {hi} inclusive, otherwise False",
             "return {lo} <= {a0} <= {hi}", _ints, {"lo": (-5, 0, 3), "hi": (10, 20, 25)}),
    Template("count_vowels", ("count_vowels", "vowels", "num_vowels"), _one(*_STR_ARGS),
             "returns the number of vowels (a, e, i, o, u) in the lowercase string {a0}",
             "return sum(1 for ch in {a0} if ch in 'aeiou')", _words),
    Template("add_prefix", ("add_prefix", "prepend", "with_prefix"), _one(*_STR_ARGS),
             "returns '{prefix}' followed by the string {a0}", "return '{prefix}' + {a0}", _words,
             {"prefix": ("re", "un", "x_", "#", "pre")}),
    Template("add_k_each", ("add_{k}_to_all", "shift_all_{k}"), _one(*_LIST_ARGS),
             "returns a new list with {k} added to every number in the list {a0}",
             "return [v + {k} for v in {a0}]", _lists, {"k": tuple(range(1, 10))}),
    Template("last_element", ("last", "tail_item", "last_item"), _one(*_LIST_ARGS),
             "returns the last element of the non-empty list {a0}", "return {a0}[-1]", _nonempty_lists),
    # Added so that the held-out set reaches 128 tasks (16 templates x 8): enough for a
    # paired before/after difference to resolve a 10-point change. Two per family.
    Template("k_minus", ("subtract_from_{k}", "take_from_{k}"), _one(*_INT_ARGS),
             "returns {k} minus {a0}", "return {k} - {a0}", _ints, {"k": tuple(range(5, 31, 5))}),
    Template("max_three", ("largest_of_three", "max_of_three", "biggest_of_three", "max3"),
             _TRIPLE_ARGS, "returns the largest of {a0}, {a1} and {a2}",
             "return max({a0}, {a1}, {a2})", _triples),
    Template("is_odd", ("is_odd", "odd", "check_odd"), _one(*_INT_ARGS),
             "returns True if {a0} is odd, otherwise False", "return {a0} % 2 == 1", _ints),
    Template("is_negative", ("is_negative", "negative", "below_zero"), _one(*_INT_ARGS),
             "returns True if {a0} is less than 0, otherwise False", "return {a0} < 0", _ints),
    Template("is_palindrome", ("is_palindrome", "palindrome", "reads_same", "same_backwards"),
             _one(*_STR_ARGS), "returns True if the string {a0} reads the same backwards, "
             "otherwise False", "return {a0} == {a0}[::-1]", _words),
    Template("last_k_chars", ("last_{k}", "tail_{k}", "suffix_{k}"), _one(*_STR_ARGS),
             "returns the last {k} characters of the string {a0} (all of it if it is shorter)",
             "return {a0}[-{k}:]", _words, {"k": (2, 3, 4)}),
    Template("min_list", ("smallest", "min_value", "lowest"), _one(*_LIST_ARGS),
             "returns the smallest number in the non-empty list {a0}", "return min({a0})",
             _nonempty_lists),
    Template("sum_squares", ("sum_squares", "square_total", "sum_of_squares"), _one(*_LIST_ARGS),
             "returns the sum of the squares of the numbers in the list {a0}",
             "return sum(v * v for v in {a0})", _lists),
)


def _grid(params: dict[str, tuple] | None) -> list[dict]:
    if not params:
        return [{}]
    keys = list(params)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(params[k] for k in keys))]


def _fill(params: dict) -> dict:
    out = dict(params)
    if "words" in out:  # a (hi, lo) label pair
        out["hi_word"], out["lo_word"] = out.pop("words")
    return out


def _call(name: str, inputs: tuple) -> str:
    return f"{name}({', '.join(repr(v) for v in inputs)})"


def make_task(t: Template, name_pattern: str, args: tuple[str, ...], params: dict,
              rng: random.Random) -> CodeTask | None:
    """One task from a template; None when no test set separates it from a constant answer."""
    p = _fill(params)
    fmt = {**p, **{f"a{i}": a for i, a in enumerate(args)}}
    name = name_pattern.format(**fmt)
    body = t.body.format(**fmt)
    solution = f"def {name}({', '.join(args)}):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    namespace: dict = {}
    exec(solution, namespace)  # our own reference code, to compute expected values
    fn = namespace[name]
    for _ in range(50):
        # Distinct inputs with at least two distinct answers, so a constant function fails;
        # one more distinct input is kept aside as the prompt's example.
        seen: dict[str, tuple] = {}
        for _ in range(100):
            inp = t.inputs(rng)
            seen.setdefault(repr(inp), inp)
            if len(seen) == TESTS_PER_TASK + 1:
                break
        if len(seen) < TESTS_PER_TASK + 1:
            continue
        example, *tests_in = seen.values()
        outs = [fn(*i) for i in tests_in]
        if len({repr(o) for o in outs}) >= 2:
            break
    else:
        return None
    tests = tuple(f"assert {_call(name, i)} == {o!r}" for i, o in zip(tests_in, outs))
    signature = f"{name}({', '.join(args)})"
    prompt = (
        f"Write a Python function `{signature}` that {t.describe.format(**fmt)}. "
        f"For example, `{_call(name, example)}` returns `{fn(*example)!r}`. {CODE_BLOCK_INSTRUCTION}"
    )
    digest = hashlib.sha1(prompt.encode()).hexdigest()[:10]
    return CodeTask(f"builtin/{t.key}/{digest}", prompt, tests, name, solution=solution)


def builtin_tasks(split: str, seed: int = 0, n: int | None = None) -> list[CodeTask]:
    """`n` tasks of the split (`train`, `test`, or `all` = both), spread evenly over templates
    (fewer when the templates run out of distinct variants)."""
    if split == "all":
        return builtin_tasks("train", seed) + builtin_tasks("test", seed)
    if split not in ("train", "test"):
        raise ValueError(f"builtin tasks have splits 'train', 'test' and 'all', not {split!r}")
    templates = TRAIN_TEMPLATES if split == "train" else TEST_TEMPLATES
    n = n if n is not None else (DEFAULT_TRAIN if split == "train" else DEFAULT_TEST)
    rng = random.Random(f"hotloop-builtin:{seed}:{split}")
    queues = []
    for t in templates:
        combos = [(name, args, params) for name in t.names for args in t.args for params in _grid(t.params)]
        rng.shuffle(combos)
        queues.append((t, iter(combos)))
    # Round robin over templates, so the mix stays even until small templates run out.
    tasks: list[CodeTask] = []
    seen: set[str] = set()
    while len(tasks) < n and queues:
        for entry in list(queues):
            if len(tasks) == n:
                break
            t, combos = entry
            for name, args, params in combos:
                task = make_task(t, name, args, params, rng)
                if task is not None and task.task_id not in seen:
                    seen.add(task.task_id)
                    tasks.append(task)
                    break
            else:
                queues.remove(entry)
    rng.shuffle(tasks)
    return tasks


def reference_tasks(split: str = "all") -> list[CodeTask]:
    """One task per template (the first variant), for checking the suite itself."""
    out = []
    for t in (TRAIN_TEMPLATES if split != "test" else ()) + (TEST_TEMPLATES if split != "train" else ()):
        grid = _grid(t.params)
        task = make_task(t, t.names[0], t.args[0], grid[0], random.Random(f"reference:{t.key}"))
        if task is None:
            raise ValueError(f"template {t.key} cannot make a task with separating tests")
        out.append(task)
    return out
