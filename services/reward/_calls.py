"""The boundary between a sample's code and its tests: two processes and the calls between them.

A sandboxed run has two processes (see `_launcher.py` for how they are made):
- the *candidate* runs the sample's code and then answers calls: `candidate_main` loads the
  code and serves requests (look up a global, call, get or set an attribute, iterate, ...)
  until its request pipe closes. It holds the code and nothing else of the run: no test, no
  expected value, no result channel.
- the *judge* runs the task's tests (trusted code) in its own process, under another uid,
  not dumpable: `judge_main` runs the task's trusted prefix, then each test case, with every
  name the tests take from the code bound to a `Remote` proxy. It decides each case and
  writes the only report of the run.

Only plain data crosses from the candidate: exact builtin types (None, bool, int, float,
complex, str, bytes, list, tuple, dict, set, frozenset, never a subclass), bounded in size and
depth, encoded as a flat JSON token list (`encode`/`decode`). Any other object the code
returns stays in the candidate and crosses as a numbered handle; on the judge's side a handle
is a `Remote` whose methods are calls back into the candidate. A `Remote` never asks the
candidate whether it equals something, and never hashes through it: `==` on a `Remote` is
identity. So `assert f(x) == expected` compares two plain values with Python's own `==` in
the judge: an object whose `__eq__` always says True, or an int subclass, arrives as a handle
and is not equal to anything but itself. Exceptions cross as the nearest builtin exception
class (an exception class the code defines arrives as its builtin base) and a message.

What the candidate can still do, by design: answer each call however it likes (a wrong
answer fails its case), be slow (the run's wall clock), refuse, exit or break the protocol
(every later call raises `CandidateFailure`, which `except Exception` in a test does not
catch: the case fails). Arguments cross as copies: nothing the code does to a list it was
given changes the judge's list, so a test that computes its expectation from its arguments
after the call (`assert f(xs) == sorted(xs)`) cannot be steered by the call. The flip side:
a test cannot see in-place changes to its arguments, only what the code returns.

Imports only the standard library: this source runs in the sandbox, where site-packages and
the service's own packages are not on the path (`_launcher.py` gets it as text).
"""

import ast
import builtins
import json
import os
import sys

FRAME_MAX = 1 << 20  # bytes of one message either way
DEPTH_MAX = 100  # nesting of one value
STR_MAX = 2000  # an exception's message, as kept

_LEAF_TAGS = {"i", "f", "c", "s", "y", "h"}
_SEQ_TAGS = {"l": list, "t": tuple, "S": set, "Z": frozenset}


class CandidateFailure(BaseException):
    """The candidate cannot answer (it exited, broke the protocol or refused a value).

    A BaseException so that a test's `except Exception:` does not turn it into a pass."""


class NotPlain(Exception):
    """A value that cannot cross: too large, too deep, or (judge side) not plain data."""


# ---- values ---------------------------------------------------------------------------------


def encode(
    value, handle_of, limit=FRAME_MAX, _type=type, _len=len, _list=list, _dict_items=dict.items,
    _reversed=reversed, _bool=bool, _int=int, _float=float, _complex=complex, _str=str,
    _bytes=bytes, _tuple=tuple, _set=set, _frozenset=frozenset, _dict=dict,
):
    """`value` as a flat token list: plain data by value, other objects as `"h", n`.

    `handle_of(obj)` gives the handle of an object that is not plain data, or None when such an
    object may not cross (then `NotPlain`). Exact types only (`type(v) is int`): a subclass of
    a builtin is not plain data. Nothing here calls a method of the value, and the builtins
    it uses are bound when it is defined, so code that patches `builtins` in its own process
    does not garble its own answers.
    """
    out = []
    size = 0
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > DEPTH_MAX:
            raise NotPlain(f"nested deeper than {DEPTH_MAX} levels")
        t = _type(v)
        if v is None:
            out.append("N")
        elif t is _bool:
            out.append("T" if v else "F")
        elif t is _int:
            out += ("i", _int.__format__(v, "x"))  # hex: no decimal digit limit either way
        elif t is _float:
            out += ("f", _float.hex(v))  # exact, nan, inf and -0.0 included
        elif t is _complex:
            out += ("c", _float.hex(v.real) + " " + _float.hex(v.imag))
        elif t is _str:
            out += ("s", v)
        elif t is _bytes:
            out += ("y", _bytes.hex(v))
        elif t is _list or t is _tuple or t is _set or t is _frozenset:
            items = _list(v)
            out += ("l" if t is _list else "t" if t is _tuple else "S" if t is _set else "Z", _len(items))
            stack.extend((item, depth + 1) for item in _reversed(items))
        elif t is _dict:
            pairs = _list(_dict_items(v))
            out += ("d", _len(pairs))
            for k, item in _reversed(pairs):
                stack.append((item, depth + 1))
                stack.append((k, depth + 1))
        else:
            h = handle_of(v)
            if h is None:
                raise NotPlain(f"a {_type_name(t)} is not plain data")
            out += ("h", h)
        size += 8 if t is not _str else _len(v) + 8
        if size > limit:
            raise NotPlain(f"larger than {limit} bytes")
    return out


def decode(tokens, resolve):
    """The value `encode` made of `tokens`; `resolve(n)` turns handle n into an object.

    The tokens come from the other process: anything malformed raises `ValueError`, and
    nothing in them is executed."""
    if type(tokens) is not list:
        raise ValueError("not a token list")
    pos = 0
    end = len(tokens)

    def take(kind):
        nonlocal pos
        if pos >= end:
            raise ValueError("the token list ends early")
        tok = tokens[pos]
        pos += 1
        if type(tok) is not kind:
            raise ValueError(f"expected a {kind.__name__} token, got {type(tok).__name__}")
        return tok

    def count():
        n = take(int)
        if n < 0 or n > end - pos:
            raise ValueError(f"bad item count {n}")
        return n

    def value(depth):
        if depth > DEPTH_MAX:
            raise ValueError("nested too deeply")
        tag = take(str)
        if tag == "N":
            return None
        if tag == "T":
            return True
        if tag == "F":
            return False
        if tag in _LEAF_TAGS:
            if tag == "h":
                return resolve(take(int))
            text = take(str)
            if tag == "s":
                return text
            if tag == "i":
                digits = text[1:] if text.startswith("-") else text
                if not digits or len(digits) > FRAME_MAX or digits.strip("0123456789abcdef"):
                    raise ValueError("bad int")
                return int(text, 16)
            if tag == "y":
                return bytes.fromhex(text)
            try:
                if tag == "f":
                    return float.fromhex(text)
                re_, _, im = text.partition(" ")
                return complex(float.fromhex(re_), float.fromhex(im))
            except (OverflowError, ValueError):
                raise ValueError("bad float") from None
        if tag in _SEQ_TAGS:
            items = [value(depth + 1) for _ in range(count())]
            try:
                return _SEQ_TAGS[tag](items)
            except TypeError:
                raise ValueError("unhashable set element") from None
        if tag == "d":
            out = {}
            for _ in range(count()):
                k = value(depth + 1)
                try:
                    out[k] = value(depth + 1)
                except TypeError:
                    raise ValueError("unhashable dict key") from None
            return out
        raise ValueError(f"unknown tag {tag[:20]!r}")

    result = value(0)
    if pos != end:
        raise ValueError("trailing tokens")
    return result


def _type_name(t) -> str:
    try:
        return str.__str__(t.__module__) + "." + str.__str__(t.__qualname__)
    except BaseException:
        return "<unnamed type>"


def describe(e) -> str:
    """`Type: message` as a plain str, bounded (what the code's exception said)."""
    try:
        name = str.__str__(type(e).__name__)
    except BaseException:
        name = "<exception>"
    try:
        text = str.__str__(str(e))
    except BaseException:
        text = "<unprintable>"
    return (name + ": " + text)[:STR_MAX]


# ---- framing ---------------------------------------------------------------------------------


def send(fd, tokens) -> None:
    data = json.dumps(tokens, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    view = memoryview(len(data).to_bytes(4, "little") + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 16))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv(fd):
    """One message's token list; None at the end of input; ValueError when malformed."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    n = int.from_bytes(head, "little")
    if n > FRAME_MAX:
        raise ValueError(f"a message of {n} bytes is over the {FRAME_MAX}-byte limit")
    data = _read_exact(fd, n)
    if data is None:
        raise ValueError("the input ended inside a message")
    try:
        return json.loads(data.decode("utf-8", "surrogatepass"))
    except (ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not a message: {type(e).__name__}") from None


# ---- the candidate -----------------------------------------------------------------------


def _builtin_base(e) -> str:
    """The nearest builtin exception class of `e` that a test may catch."""
    for cls in type(e).__mro__:
        if getattr(builtins, getattr(cls, "__name__", ""), None) is cls:
            return cls.__name__
    return "Exception"


_OPS = {
    "iter": iter,
    "next": next,
    "len": len,
    "bool": bool,
    "str": str,
    "getitem": lambda obj, key: obj[key],
    "setitem": lambda obj, key, value: obj.__setitem__(key, value),
    "delitem": lambda obj, key: obj.__delitem__(key),
    "contains": lambda obj, item: item in obj,
    "getattr": getattr,
    "setattr": setattr,
}


def _crosses_as_handle(value, handle_of) -> bool:
    try:
        return encode(value, handle_of, limit=64)[0] == "h"
    except NotPlain:
        return False  # plain data (too large for this look, so not a handle)


def candidate_main(code: str, names: list, rfd: int, wfd: int) -> None:
    """Load the code, then answer the judge's requests until the request pipe closes.

    The message that says the code loaded carries the functions, classes and other objects
    among `names` (the names the tests use: the service reads them off the tests) as handles,
    which saves the judge a round trip per name. Runs as the untrusted code's own process: nothing here is relied on by the judge,
    which checks every reply. Ends with `os._exit(0)` at the end of input."""
    table = []
    known = {}

    def handle_of(obj):
        key = id(obj)
        if key not in known:
            known[key] = len(table)
            table.append(obj)  # kept alive, so the id is never reused by another object
        return known[key]

    def resolve(n):
        if not 0 <= n < len(table):
            raise ValueError(f"unknown handle {n}")
        return table[n]

    def reply(tokens_of):
        try:
            tokens = tokens_of()
        except NotPlain as e:
            tokens = encode(("r", seq, f"the value cannot be sent: {e}"), handle_of)
        send(wfd, tokens)

    seq = 0
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<solution>", "exec"), namespace)
        # Functions, classes and other objects only: a plain global may change with the
        # calls, so the judge reads it when a test does.
        found = {name: namespace[name] for name in names if name in namespace
                 and _crosses_as_handle(namespace[name], handle_of)}
        send(wfd, encode(("loaded", found), handle_of))
    except BaseException as e:
        send(wfd, encode(("loadfail", describe(e), isinstance(e, MemoryError)), handle_of))
        os._exit(0)
    while True:
        try:
            msg = recv(rfd)
        except ValueError:
            os._exit(0)
        if msg is None:
            os._exit(0)
        try:
            op, seq, *fields = decode(msg, resolve)
        except BaseException as e:
            send(wfd, encode(("r", seq, f"bad request: {describe(e)}"), handle_of))
            continue
        try:
            if op == "global":
                (name,) = fields
                if name not in namespace:
                    raise NameError(f"name {name!r} is not defined by the code")
                value = namespace[name]
            elif op == "call":
                fn, args, kwargs = fields
                value = fn(*args, **kwargs)
            else:
                value = _OPS[op](*fields)
            reply(lambda: encode(("ok", seq, value), handle_of))
        except BaseException as e:
            err = ("x", seq, _builtin_base(e), describe(e))
            reply(lambda: encode(err, handle_of))


# ---- the judge -----------------------------------------------------------------------------


class Candidate:
    """The judge's end of the pipes: one request at a time, every reply checked."""

    def __init__(self, rfd: int, wfd: int):
        self._rfd, self._wfd = rfd, wfd
        self._seq = 0
        self.gone = ""  # why it can no longer answer
        self.oom = False  # it raised MemoryError
        self._remotes: dict[int, Remote] = {}  # one proxy per object: `is` works as in Python

    def _fail(self, why: str):
        self.gone = self.gone or why
        raise CandidateFailure(self.gone)

    def _receive(self):
        try:
            msg = recv(self._rfd)
        except ValueError as e:
            self._fail(f"the code's process broke the call protocol: {e}")
        if msg is None:
            self._fail("the code's process ended")
        try:
            return decode(msg, self._remote)
        except (ValueError, MemoryError, RecursionError) as e:
            self._fail(f"the code's process sent a malformed value: {e}")

    def _remote(self, n):
        remote = self._remotes.get(n)
        if remote is None:
            remote = self._remotes[n] = Remote(self, n)
        return remote

    def loaded(self) -> str:
        """Wait for the code to load: "" when it did, else why not. Sets `self.globals` to
        the globals the candidate sent along (names the tests use that the code defines)."""
        self.globals = {}
        if self.gone:
            return self.gone
        try:
            msg = self._receive()
        except CandidateFailure:
            return f"{self.gone} before the code loaded"
        if type(msg) is tuple and len(msg) == 2 and msg[0] == "loaded" and type(msg[1]) is dict:
            self.globals = {k: v for k, v in msg[1].items() if type(k) is str}
            return ""
        if type(msg) is tuple and len(msg) == 3 and msg[0] == "loadfail" and type(msg[1]) is str:
            self.oom = msg[2] is True
            self.gone = "while loading the code: " + msg[1][:STR_MAX]
            return self.gone
        self.gone = "the code's process broke the call protocol while loading"
        return self.gone

    def request(self, op: str, *fields):
        if self.gone:
            raise CandidateFailure(self.gone)
        self._seq += 1
        seq = self._seq
        try:
            tokens = encode((op, seq, *fields), self._handle_of)
        except NotPlain as e:
            raise TypeError(f"cannot pass this to the code under test: {e} (only plain data "
                            "and the code's own objects cross)") from None
        try:
            send(self._wfd, tokens)
        except OSError:
            self._fail("the code's process ended")
        reply = self._receive()
        if type(reply) is not tuple or len(reply) < 3 or reply[1] != seq:
            self._fail("the code's process broke the call protocol")
        kind = reply[0]
        if kind == "ok" and len(reply) == 3:
            return reply[2]
        if kind == "x" and len(reply) == 4 and type(reply[2]) is str and type(reply[3]) is str:
            raise self._exception(reply[2], reply[3])
        if kind == "r" and type(reply[2]) is str:
            raise CandidateFailure(reply[2][:STR_MAX])
        self._fail("the code's process broke the call protocol")

    def _handle_of(self, obj):
        if type(obj) is Remote and object.__getattribute__(obj, "_owner") is self:
            return object.__getattribute__(obj, "_handle")
        return None

    def _exception(self, name: str, message: str) -> BaseException:
        message = message[:STR_MAX]
        cls = getattr(builtins, name, None)
        if name == "MemoryError":
            self.oom = True
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                return cls(message)
            except BaseException:  # a builtin that takes other arguments (UnicodeError's kin)
                pass
        return CandidateFailure(f"the code raised {message}")


class Remote:
    """An object that lives in the candidate; every use is a request to it.

    Equality and hashing are identity, on purpose: the candidate never decides whether its
    object equals something. Arithmetic and ordering are not forwarded (TypeError)."""

    __slots__ = ("_owner", "_handle")
    _FORWARDED_DUNDERS = ("__name__", "__qualname__", "__doc__", "__module__")

    def __init__(self, owner: Candidate, handle: int):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_handle", handle)

    def _op(self, op, *args):
        return object.__getattribute__(self, "_owner").request(op, self, *args)

    def __call__(self, *args, **kwargs):
        return object.__getattribute__(self, "_owner").request("call", self, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name not in Remote._FORWARDED_DUNDERS:
            raise AttributeError(name)  # protocols the judge's own libraries probe for
        return self._op("getattr", name)

    def __setattr__(self, name, value):
        self._op("setattr", name, value)

    def __iter__(self):
        return self._op("iter")

    def __next__(self):
        return self._op("next")

    def __len__(self):
        return self._op("len")

    def __bool__(self):
        return self._op("bool")

    def __str__(self):
        return self._op("str")

    def __repr__(self):
        return f"<object #{object.__getattribute__(self, '_handle')} of the code under test>"

    def __getitem__(self, key):
        return self._op("getitem", key)

    def __setitem__(self, key, value):
        self._op("setitem", key, value)

    def __delitem__(self, key):
        self._op("delitem", key)

    def __contains__(self, item):
        return self._op("contains", item)

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__


class _Missing:
    """The entry point the code did not define: any use is the NameError it would have been."""

    def __init__(self, why: str):
        self._why = why

    def __call__(self, *args, **kwargs):
        raise NameError(self._why)

    def __getattr__(self, name):
        raise NameError(object.__getattribute__(self, "_why"))


def _short(v) -> str:
    if type(v) is int and v.bit_length() > 256:
        # repr of an int past 4300 digits raises (sys.get_int_max_str_digits)
        return f"an int of about {int(v.bit_length() * 0.30103) + 1} digits"
    try:
        text = repr(v)  # plain data or a `Remote`: no code of the candidate runs here
    except Exception as e:
        return f"a {type(v).__name__} that cannot be shown ({type(e).__name__})"
    return text if len(text) <= 80 else text[:77] + "..."


def _hl_explain(expression: str, value, expected) -> str:
    return f"{expression} returned {_short(value)}, expected {_short(expected)}"


class _Explain(ast.NodeTransformer):
    """`assert <a> == <b>` without a message gets one that says what came back, as pytest's
    rewriting does: `f(1, 2) returned 2, expected 3`. The values are captured with `:=`, so
    each side is still evaluated once."""

    def visit_Assert(self, node: ast.Assert) -> ast.Assert:
        test = node.test
        if node.msg is not None or not (isinstance(test, ast.Compare) and len(test.ops) == 1
                                         and isinstance(test.ops[0], ast.Eq)):
            return node
        left, right = test.left, test.comparators[0]
        names = ("_hl_left", "_hl_right")
        captured = ast.Compare(ast.NamedExpr(ast.Name(names[0], ast.Store()), left), test.ops,
                               [ast.NamedExpr(ast.Name(names[1], ast.Store()), right)])
        value, expected = (1, 0) if isinstance(left, ast.Constant) and not isinstance(right, ast.Constant) else (0, 1)
        message = ast.Call(ast.Name("_hl_explain", ast.Load()), [
            ast.Constant(ast.unparse((left, right)[value])),
            ast.Name(names[value], ast.Load()), ast.Name(names[expected], ast.Load()),
        ], [])
        return ast.copy_location(ast.Assert(captured, message), node)


def explained(source: str) -> str:
    """A test case with explained asserts, as source (unchanged when it does not parse).

    Done by the service, once per case, not by the judge per run: the rewrite costs more
    than the run's own calls."""
    try:
        return ast.unparse(ast.fix_missing_locations(_Explain().visit(ast.parse(source))))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return source


class _Names(dict):
    """The judge's builtins, then the standard library's modules, then the code's globals.

    A name a test uses without defining it resolves in that order, so the code cannot stand
    in for `abs`, `sorted` or `math` in the tests' own arithmetic; only names that are none
    of those reach the candidate."""

    def __init__(self, candidate: Candidate):
        super().__init__(builtins.__dict__, _hl_explain=_hl_explain)
        self._candidate = candidate

    def __missing__(self, name):
        if name in sys.stdlib_module_names:
            try:
                return __import__(name)
            except ImportError:
                pass
        if name in self._candidate.globals:
            return self._candidate.globals[name]
        value = self._candidate.request("global", name)
        if type(value) is Remote:
            self[name] = value  # functions and classes: one look-up, not one per use
        return value


def judge_main(tests: dict, rfd: int, wfd: int, report_fd: int) -> None:
    """Run the task's trusted prefix, then each case; write one report line; exit.

    Report: `result \\t <bits> \\t <oom> \\t <error>`, one bit per case (1: ran without
    raising), the first failing case's error last."""
    candidate = Candidate(rfd, wfd)
    cases = tests["cases"]
    entry_point = tests["entry_point"]
    error = candidate.loaded()
    loaded = not error
    ns = {"__name__": "__main__", "__builtins__": _Names(candidate)}
    if loaded and tests["prefix"]:
        # The task's own code (imports, helper functions, the stub), run here so the tests'
        # helpers are the task's and not the sample's. A prefix that does not run alone
        # (one the completion must finish, say) brings no names: then they come from the code.
        try:
            exec(compile(tests["prefix"], "<task prefix>", "exec"), ns)
        except BaseException:
            ns = {"__name__": "__main__", "__builtins__": ns["__builtins__"]}
    if loaded and entry_point:
        try:
            ns[entry_point] = candidate.globals[entry_point] if entry_point in candidate.globals \
                else candidate.request("global", entry_point)
        except NameError as e:
            ns[entry_point] = _Missing(str(e))
        except CandidateFailure:
            pass
    bits = []
    for i, case in enumerate(cases):
        ok = False
        if loaded:
            try:
                exec(compile(case, f"<test case {i}>", "exec"), ns)
                ok = True
            except BaseException as e:
                error = error or f"test case {i}: " + describe(e)
        bits.append("1" if ok else "0")
    error = error.replace("\t", " ").replace("\n", " ").replace("\r", " ")[:500]
    line = "\t".join(["result", "".join(bits), "1" if candidate.oom else "0", error]) + "\n"
    os.write(report_fd, line.encode("utf-8", "backslashreplace"))
    os._exit(0)
