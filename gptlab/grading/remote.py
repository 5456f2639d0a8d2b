"""Calling a learner's code from a process it never ran in: plain data over a socket.

Where this sits: beside the pipeline, between the autograder and the learner's kernel. When
``course autograde`` (or ``nbgrader autograde`` with the course's config) grades a notebook, the
learner's cells run in a Jupyter kernel, but the graded test cells do not: for each of them the
trusted process (the one running nbgrader, :mod:`gptlab.course.execute`) runs the check itself and
asks the kernel, through :func:`serve`, to call the learner's functions on the inputs it sends.

* What crosses the socket is plain data: ``None``, booleans, numbers, strings, lists, tuples,
  dicts, dtypes, and tensors as raw bytes with their dtype and shape. The trusted side rebuilds
  every tensor as a plain ``torch.Tensor`` from those bytes (never a subclass, never a pickle), so
  nothing the learner's process sends can run code in the trusted process or answer a comparison.
* Objects that are not plain data (the learner's modules, classes, caches) stay in the kernel; the
  trusted side holds a :class:`Remote` handle and may call it, read its attributes (plain values
  come back as copies), and use the few module operations below (:func:`load_params`,
  :func:`same_object`, :func:`is_module`, ...). Generators a check passes are sent as their state
  and synchronised back after the call; small trusted objects the learner's function uses (a toy
  language model, a counting cache) are rebuilt in the kernel from a recipe
  (``__gptlab_portable__``) and their state is sent back (``__gptlab_state__`` /
  ``__gptlab_sync__``).
* The learner's output while a function runs (prints, stderr, warnings) is captured and sent back
  to be shown, never scored. A call that does not answer within the test's time limit is a
  :class:`LearnerTimeout`; a kernel that dies is a :class:`LearnerCrashed`.

The checks are written once: in a learner's own notebook they get the learner's function itself
(and use ``isinstance``/``copy_`` as usual through the helpers below); in the autograder they get
:class:`Remote` handles. Whatever the kernel answers, the verdict is decided by the check in the
trusted process.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import io
import json
import math
import socket
import struct
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .core import DelegationError, Forbidden, LearnerCrashed, LearnerTimeout, forbid, forbidden_specs, resolve_forbidden

__all__ = [
    "Remote",
    "Connection",
    "LearnerException",
    "LearnerTimeout",
    "LearnerCrashed",
    "ProtocolError",
    "serve",
    "is_module",
    "is_module_class",
    "isinstance_of",
    "load_params",
    "same_object",
    "make",
    "encode",
    "decode",
]

MAX_HEADER = 64 << 20
MAX_BUFFER = 2 << 30
MAX_OUTPUT = 4000  # characters of captured learner output kept per call

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class ProtocolError(Exception):
    """The other side sent something that is not a message of this protocol."""


class LearnerException(Exception):
    """An exception raised by the learner's code, rebuilt from its type name and message only."""

    type_name = "Exception"


# Builtin exception types a check may catch by type (KeyError for an unknown character, ValueError for a
# sequence that is too long, ...): rebuilt as themselves, from the message only.
_BUILTIN_EXCEPTIONS = {name: getattr(builtins, name) for name in (
    "ArithmeticError", "AssertionError", "AttributeError", "IndexError", "KeyError", "LookupError",
    "NameError", "NotImplementedError", "OverflowError", "RecursionError", "RuntimeError", "StopIteration",
    "TypeError", "UnboundLocalError", "ValueError", "ZeroDivisionError", "MemoryError", "UnicodeError",
    "FloatingPointError", "ImportError", "ModuleNotFoundError")}


def _exception(type_name: str, message: str) -> BaseException:
    """The trusted side's copy of an exception raised in the learner's process."""
    message = str(message)[:20000]
    if type_name == "DelegationError":
        return DelegationError(message)
    cls = _BUILTIN_EXCEPTIONS.get(type_name)
    if cls is not None:
        return cls(message) if type_name != "KeyError" else KeyError(message)
    name = "".join(ch for ch in str(type_name) if ch.isalnum() or ch == "_")[:60] or "Exception"
    if not name[0].isalpha():
        name = "E" + name
    return type(name, (LearnerException,), {"type_name": name})(message)


# --------------------------------------------------------------------------- the codec


def _tensor_bytes(t: Tensor) -> bytes:
    t = t.detach()
    if type(t) is not Tensor:
        t = t.as_subclass(Tensor)
    t = t.cpu().contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


def _tensor_from(buf: bytes, dtype_name: str, shape: list[int]) -> Tensor:
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise ProtocolError(f"unknown dtype {dtype_name!r}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ProtocolError(f"bad tensor shape {shape!r}")
    n = math.prod(shape)
    size = n * torch.empty((), dtype=dtype).element_size()
    if len(buf) != size:
        raise ProtocolError(f"a tensor of shape {shape} and dtype {dtype_name} needs {size} bytes, got {len(buf)}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def encode(value: Any, bufs: list[bytes], ref: Callable[[Any], dict] | None = None, depth: int = 0) -> Any:
    """``value`` as JSON-able data, its tensors' bytes appended to ``bufs``.

    ``ref(obj)`` encodes anything that is not plain data (a handle); without it such a value is an
    error. Containers nest at most 32 deep.
    """
    if depth > 32:
        raise ProtocolError("a value nested more than 32 levels deep")
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**63 else {"$bigint": str(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, Tensor):
        if value.device.type == "meta":
            return {"$tensor": None, "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                    "device": "meta"}
        bufs.append(_tensor_bytes(value))
        out = {"$tensor": len(bufs) - 1, "dtype": str(value.dtype).removeprefix("torch."),
               "shape": list(value.shape), "device": value.device.type}
        if value.requires_grad:
            out["grad"] = True
        return out
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.Size):
        return {"$tuple": [int(v) for v in value]}
    if isinstance(value, torch.Generator):
        bufs.append(value.get_state().numpy().tobytes())
        return {"$generator": len(bufs) - 1}
    if type(value).__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.generic):
            return encode(value.item(), bufs, ref, depth + 1)
        if isinstance(value, np.ndarray):
            return {"$ndarray": encode(torch.from_numpy(np.ascontiguousarray(value)), bufs, ref, depth + 1)}
    if isinstance(value, list):
        return [encode(v, bufs, ref, depth + 1) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"$tuple": [encode(v, bufs, ref, depth + 1) for v in value]}
    if isinstance(value, dict):
        return {"$dict": [[encode(k, bufs, ref, depth + 1), encode(v, bufs, ref, depth + 1)] for k, v in value.items()]}
    if isinstance(value, range):
        return {"$range": [value.start, value.stop, value.step]}
    if ref is None:
        raise ProtocolError(f"cannot send a {type(value).__name__} as plain data")
    return ref(value)


def decode(data: Any, bufs: list[bytes], obj: Callable[[dict], Any] | None = None, depth: int = 0,
           grads: bool = False) -> Any:
    """The value :func:`encode` made; ``obj(d)`` turns a handle ``d`` into an object. With
    ``grads`` (the learner's side only), a tensor sent with ``requires_grad`` gets it back."""
    if depth > 34:
        raise ProtocolError("a value nested too deep")
    if data is None or isinstance(data, bool | int | float | str):
        return data
    if isinstance(data, list):
        return [decode(v, bufs, obj, depth + 1, grads) for v in data]
    if not isinstance(data, dict) or len(data) == 0:
        raise ProtocolError(f"unexpected {type(data).__name__} in a message")
    if "$tensor" in data:
        if data.get("device") == "meta":
            dtype = _DTYPES.get(data.get("dtype"))
            if dtype is None:
                raise ProtocolError("unknown dtype")
            return torch.empty(data["shape"], dtype=dtype, device="meta")
        i = data["$tensor"]
        if not isinstance(i, int) or not 0 <= i < len(bufs):
            raise ProtocolError("a tensor refers to a missing buffer")
        t = _tensor_from(bufs[i], data.get("dtype"), data.get("shape"))
        if grads and data.get("grad") is True and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t
    if "$tuple" in data:
        return tuple(decode(v, bufs, obj, depth + 1, grads) for v in data["$tuple"])
    if "$dict" in data:
        out = {}
        for pair in data["$dict"]:
            k, v = (decode(x, bufs, obj, depth + 1, grads) for x in pair)
            try:
                out[k] = v
            except TypeError:
                raise ProtocolError("a dict key that cannot be hashed") from None
        return out
    if "$float" in data:
        return float(data["$float"]) if data["$float"] in ("nan", "inf", "-inf") else math.nan
    if "$bigint" in data:
        text = data["$bigint"]
        if not isinstance(text, str) or len(text) > 4000:
            raise ProtocolError("bad integer")
        return int(text)
    if "$dtype" in data:
        d = _DTYPES.get(data["$dtype"])
        if d is None:
            raise ProtocolError("unknown dtype")
        return d
    if "$device" in data:
        return torch.device(str(data["$device"]))
    if "$range" in data:
        return range(*(int(v) for v in data["$range"]))
    if "$ndarray" in data:
        return decode(data["$ndarray"], bufs, obj, depth + 1).numpy()
    if "$generator" in data:
        g = torch.Generator()
        g.set_state(torch.frombuffer(bytearray(bufs[data["$generator"]]), dtype=torch.uint8).clone())
        return g
    if obj is None:
        raise ProtocolError(f"unexpected object in a message: {sorted(data)[:3]}")
    return obj(data)


# --------------------------------------------------------------------------- framing


def _send(sock: socket.socket, header: dict, bufs: list[bytes]) -> None:
    head = json.dumps({**header, "nbufs": len(bufs)}).encode()
    parts = [struct.pack(">I", len(head)), head]
    for b in bufs:
        parts.append(struct.pack(">Q", len(b)))
        parts.append(b)
    sock.sendall(b"".join(parts))


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, deadline: float | None = None) -> tuple[dict, list[bytes]]:
    (size,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if size > MAX_HEADER:
        raise ProtocolError(f"a message header of {size} bytes")
    try:
        header = json.loads(_recv_exact(sock, size, deadline))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"a message header that is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ProtocolError("a message header that is not an object")
    n = header.get("nbufs", 0)
    if not isinstance(n, int) or not 0 <= n <= 100000:
        raise ProtocolError("bad buffer count")
    bufs = []
    for _ in range(n):
        (length,) = struct.unpack(">Q", _recv_exact(sock, 8, deadline))
        if length > MAX_BUFFER:
            raise ProtocolError(f"a buffer of {length} bytes")
        bufs.append(_recv_exact(sock, length, deadline))
    return header, bufs


# --------------------------------------------------------------------------- the trusted side


class Remote:
    """A handle on an object that lives in the learner's process (a function, class or instance).

    Calling it calls the object there (arguments sent as plain data, the result received as plain
    data or as another handle); reading an attribute reads it there. ``len()`` and iteration work on
    sized containers (an ``nn.ModuleList``). Nothing the handle returns can run code here.
    """

    __slots__ = ("_conn", "_ref", "_type", "_mro", "_flags", "_label")
    __gptlab_remote__ = True  # how gptlab.grading.core.call recognises a handle without importing this module

    def __init__(self, conn: Connection, ref: int, type_name: str, mro: list[str], flags: dict, label: str):
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", type_name)
        object.__setattr__(self, "_mro", tuple(mro))
        object.__setattr__(self, "_flags", dict(flags))
        object.__setattr__(self, "_label", label)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._conn.call(self, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._conn.request("getattr", ref=self._ref, name=name, label=f"{self._label}.{name}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("attributes of the learner's objects are read-only here")

    def __len__(self) -> int:
        n = self._conn.request("len", ref=self._ref, label=self._label)
        if not isinstance(n, int) or n < 0:
            raise TypeError(f"len() of {self._label} gave {n!r}")
        return n

    def __iter__(self):
        items = self._conn.request("list", ref=self._ref, label=self._label)
        if not isinstance(items, list):
            raise TypeError(f"{self._label} is not iterable")
        return iter(items)

    def __getitem__(self, key: Any) -> Any:
        return self._conn.request("getitem", ref=self._ref, key=key, label=f"{self._label}[{key!r}]")

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<learner's {self._type}>"

    @property
    def __name__(self) -> str:  # for messages that name a learner's function
        return self._label.rsplit(".", 1)[-1]


class Connection:
    """The trusted side of one connection to :func:`serve` in the learner's kernel.

    ``deadline`` (``time.monotonic()`` seconds) bounds every answer: past it a request raises
    :class:`LearnerTimeout` and the connection is closed. ``output`` collects what the learner's
    code printed or warned during calls (shown in the feedback, never scored). ``pending`` is the
    label of the call being waited for (the function that hung, after a timeout).
    """

    def __init__(self, sock: socket.socket, deadline: float | None = None, limit_s: float | None = None):
        self.sock = sock
        self.deadline = deadline
        self.limit_s = limit_s
        self.output: list[str] = []
        self.pending: str | None = None
        self.failure: Exception | None = None

    # -- the requests ----------------------------------------------------------------------------

    def _encode_arg(self, value: Any, bufs: list[bytes], portables: list) -> Any:
        def ref(obj: Any) -> dict:
            if isinstance(obj, Remote):
                if obj._conn is not self:
                    raise ProtocolError("a handle from another connection")
                return {"$ref": obj._ref}
            recipe = getattr(obj, "__gptlab_portable__", None)
            if callable(recipe):
                factory, fargs = recipe()
                portables.append(obj)
                return {"$portable": factory, "args": encode(list(fargs), bufs), "slot": len(portables) - 1}
            if isinstance(obj, type) and obj.__module__.startswith("gptlab"):
                return {"$class": f"{obj.__module__}:{obj.__qualname__}"}
            raise ProtocolError(f"cannot send a {type(obj).__name__} to the learner's process")

        return encode(value, bufs, ref)

    def _object(self, d: dict) -> Any:
        if "$obj" not in d:
            raise ProtocolError(f"unexpected object in a message: {sorted(d)[:3]}")
        ref = d["$obj"]
        if not isinstance(ref, int):
            raise ProtocolError("bad object handle")
        flags = d.get("flags") if isinstance(d.get("flags"), dict) else {}
        mro = [str(m)[:200] for m in d.get("mro", [])][:64] if isinstance(d.get("mro"), list) else []
        return Remote(self, ref, str(d.get("type", "object"))[:200], mro, flags, str(d.get("label", "object"))[:200])

    def request(self, op: str, *, label: str = "", **fields: Any) -> Any:
        bufs: list[bytes] = []
        portables: list = []
        header = {"op": op}
        for k, v in fields.items():
            if k == "ref":
                header["ref"] = v
            else:
                header[k] = self._encode_arg(v, bufs, portables)
        reply, rbufs = self._exchange(header, bufs, label)
        return self._result(reply, rbufs, [], portables, label)

    def call(self, fn: Remote, args: tuple, kwargs: dict, forbidden: tuple = (), name: str = "") -> Any:
        """Call the learner's ``fn(*args, **kwargs)`` in its process; tensors, generators and portable
        objects among the arguments are brought up to date with what the call did to them."""
        bufs: list[bytes] = []
        portables: list = []
        flat = list(args) + list(kwargs.values())
        header = {"op": "call", "ref": fn._ref,
                  "args": self._encode_arg(list(args), bufs, portables),
                  "kwargs": self._encode_arg(dict(kwargs), bufs, portables),
                  "forbidden": forbidden_specs(forbidden), "name": name or fn._label,
                  "seed": torch.initial_seed() % (2**63), "threads": torch.get_num_threads()}
        label = name or fn._label
        reply, rbufs = self._exchange(header, bufs, label)
        return self._result(reply, rbufs, flat, portables, label)

    def lookup(self, name: str) -> Any:
        """The learner's ``name`` (a handle, or a plain value); ``NameError`` if it is not defined."""
        return self.request("lookup", name=name, label=name)

    def done(self) -> None:
        with contextlib.suppress(Exception):
            _send(self.sock, {"op": "done"}, [])
        with contextlib.suppress(Exception):
            self.sock.close()

    # -- below the requests ----------------------------------------------------------------------

    def _exchange(self, header: dict, bufs: list[bytes], label: str) -> tuple[dict, list[bytes]]:
        if self.failure is not None:
            raise self.failure
        self.pending = label
        try:
            _send(self.sock, header, bufs)
            reply, rbufs = _recv(self.sock, self.deadline)
        except (TimeoutError, socket.timeout):
            self.failure = LearnerTimeout(
                f"{label} was stopped after {self.limit_s:g} s, the time limit of this test (an endless loop, or code "
                "far too slow?)." if self.limit_s else f"{label} did not answer in time.")
            self.failure.label = label
            with contextlib.suppress(Exception):
                self.sock.close()
            raise self.failure from None
        except (EOFError, ConnectionError, OSError):
            self.failure = LearnerCrashed(
                f"the Python kernel died while running {label} (os._exit, a crash in compiled code, or out of "
                "memory?).")
            self.failure.label = label
            raise self.failure from None
        except ProtocolError as e:
            self.failure = LearnerCrashed(f"the learner's process sent a reply that is not plain data ({e}) while "
                                          f"running {label}.")
            self.failure.label = label
            raise self.failure from None
        self.pending = None
        return reply, rbufs

    def _result(self, reply: dict, rbufs: list[bytes], flat: list, portables: list, label: str) -> Any:
        out = reply.get("output")
        if isinstance(out, str) and out:
            self.output.append(f"{label}: {out[:MAX_OUTPUT]}")
        try:
            after = reply.get("after") or {}
            if isinstance(after, dict):
                self._sync(after, rbufs, flat, portables)
            if "error" in reply:
                err = reply["error"] if isinstance(reply["error"], dict) else {}
                raise _exception(str(err.get("type", "Exception")), str(err.get("message", "")))
            value = decode(reply.get("value"), rbufs, self._object)
            if isinstance(value, Tensor) and isinstance(reply.get("grads"), list):
                value = _with_gradients(value, reply["grads"], rbufs, flat)
            return value
        except ProtocolError as e:
            self.failure = LearnerCrashed(f"the learner's process sent a reply that is not plain data ({e}) while "
                                          f"running {label}.")
            raise self.failure from None

    def _sync(self, after: dict, rbufs: list[bytes], flat: list, portables: list) -> None:
        for key, data in after.get("args", []) if isinstance(after.get("args"), list) else []:
            if not isinstance(key, int) or not 0 <= key < len(flat):
                continue
            target, new = flat[key], decode(data, rbufs)
            if isinstance(target, Tensor) and isinstance(new, Tensor):
                with torch.no_grad():
                    if new.shape == target.shape and new.dtype == target.dtype:
                        target.copy_(new)
                    else:
                        target.data = new
            elif isinstance(target, torch.Generator) and isinstance(new, torch.Generator):
                target.set_state(new.get_state())
        for slot, data in after.get("portables", []) if isinstance(after.get("portables"), list) else []:
            if isinstance(slot, int) and 0 <= slot < len(portables):
                sync = getattr(portables[slot], "__gptlab_sync__", None)
                if callable(sync):
                    sync(decode(data, rbufs))


# --------------------------------------------------------------------------- the learner's side


def _flags(obj: Any) -> dict:
    return {
        "callable": callable(obj),
        "is_class": isinstance(obj, type),
        "is_module_class": isinstance(obj, type) and issubclass(obj, torch.nn.Module),
        "is_module": isinstance(obj, torch.nn.Module),
        "is_function": isinstance(obj, types.FunctionType),
    }


class _Worker:
    """Answers the trusted side's requests inside the learner's process (see :func:`serve`)."""

    def __init__(self, namespace: dict):
        self.ns = namespace
        self.objects: dict[int, Any] = {}
        self.seed: int | None = None

    def ref(self, obj: Any, label: str = "object") -> dict:
        self.objects[id(obj)] = obj
        cls = type(obj)
        try:
            mro = [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__]
        except Exception:  # noqa: BLE001
            mro = []
        return {"$obj": id(obj), "type": f"{cls.__module__}.{cls.__qualname__}", "mro": mro, "flags": _flags(obj),
                "label": label}

    def out(self, value: Any, bufs: list[bytes], label: str) -> Any:
        if isinstance(value, types.GeneratorType):
            value = list(value)
        if isinstance(value, torch.nn.Parameter):
            value = value.detach()
        return encode(value, bufs, lambda o: self.ref(o, label))

    def obj(self, d: dict, portables: list) -> Any:
        if "$ref" in d:
            return self.objects[d["$ref"]]
        if "$portable" in d:
            factory = _resolve(d["$portable"])
            args = decode(d.get("args", []), self._bufs, lambda x: self.obj(x, portables))
            made = factory(*args)
            portables.append((d.get("slot", len(portables)), made))
            return made
        if "$class" in d:
            return _resolve(d["$class"])
        raise ProtocolError("unknown object")

    def handle(self, header: dict, bufs: list[bytes]) -> tuple[dict, list[bytes]]:
        self._bufs = bufs
        out_bufs: list[bytes] = []
        op = header.get("op")
        portables: list = []
        dec = lambda x: decode(x, bufs, lambda d: self.obj(d, portables), grads=True)  # noqa: E731
        label = "object"
        if op == "lookup":
            name = header.get("name")
            label = str(dec(name))
            if label not in self.ns:
                return {"error": {"type": "NameError", "message": f"name {label!r} is not defined"}}, []
            return {"value": self.out(self.ns[label], out_bufs, label)}, out_bufs
        if op == "make":
            factory = _resolve(str(dec(header.get("factory"))))
            return {"value": self.out(factory(*dec(header.get("args"))), out_bufs, "object")}, out_bufs
        target = self.objects.get(header.get("ref"))
        if target is None:
            return {"error": {"type": "RuntimeError", "message": "unknown object handle"}}, []
        if op == "getattr":
            name = str(dec(header.get("name")))
            return {"value": self.out(getattr(target, name), out_bufs, name)}, out_bufs
        if op == "len":
            return {"value": len(target)}, []
        if op == "list":
            return {"value": self.out(list(target), out_bufs, "item")}, out_bufs
        if op == "getitem":
            return {"value": self.out(target[dec(header.get("key"))], out_bufs, "item")}, out_bufs
        if op == "load":
            values = dec(header.get("values"))
            state = target.state_dict(keep_vars=True)
            with torch.no_grad():
                for k, v in values.items():
                    state[k].copy_(v.to(dtype=state[k].dtype, device=state[k].device))
            return {"value": None}, []
        if op == "same":
            a, b = (_path(target, str(dec(header.get(k)))) for k in ("a", "b"))
            return {"value": a is b}, []
        if op == "call":
            return self._call(target, header, dec, portables, out_bufs), out_bufs
        return {"error": {"type": "RuntimeError", "message": f"unknown operation {op!r}"}}, []


    def _call(self, target: Callable, header: dict, dec: Callable, portables: list, out_bufs: list[bytes]) -> dict:
        """Run the learner's ``target(*args, **kwargs)`` with the forbidden entry points
        instrumented and its output captured; the reply says what it returned (or raised), what it
        printed, which arguments it changed, the state of the portable objects, and the gradient of
        a scalar result with respect to the arguments that need one."""
        seed, threads = header.get("seed"), header.get("threads")
        if isinstance(seed, int) and seed != self.seed:  # the grader's random state, as in its own process
            torch.manual_seed(seed)
            self.seed = seed
        if isinstance(threads, int) and 0 < threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        args = dec(header.get("args"))
        kwargs = dec(header.get("kwargs"))
        forbidden = _forbidden_from_specs(header.get("forbidden") or [])
        flat = list(args) + list(kwargs.values())
        before = {i: a.detach().clone() for i, a in enumerate(flat) if isinstance(a, Tensor)
                  and a.device.type != "meta"}
        captured = io.StringIO()
        error = value = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured), \
                        forbid(forbidden, str(header.get("name", "your function"))):
                    value = target(*args, **kwargs)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - SystemExit too: it is the learner's answer
                error = {"type": type(e).__name__, "message": str(e)}
        text = captured.getvalue()
        for w in caught:
            text += f"{w.category.__name__}: {w.message}\n"
        reply = {"output": text[-MAX_OUTPUT:], "after": _after_call(flat, before, portables, out_bufs)}
        if error is None and isinstance(value, Tensor) and value.requires_grad and value.numel() == 1:
            grads = _scalar_gradients(value, flat, out_bufs)
            if grads is not None:
                reply["grads"] = grads
        if error is not None:
            reply["error"] = error
        else:
            reply["value"] = self.out(value, out_bufs, str(header.get("name", "result")))
        return reply


def _after_call(flat: list, before: dict[int, Tensor], portables: list, out_bufs: list[bytes]) -> dict:
    """What a call changed: the tensor arguments changed in place, every generator's state, and
    the state of each portable object made for the call."""
    after_args = []
    for i, old in before.items():
        new = flat[i].detach()
        if new.shape != old.shape or new.dtype != old.dtype or not _same(new, old):
            after_args.append([i, encode(new, out_bufs)])
    for i, a in enumerate(flat):
        if isinstance(a, torch.Generator):
            after_args.append([i, encode(a, out_bufs)])
    after_port = []
    for slot, made in portables:
        state = getattr(made, "__gptlab_state__", None)
        if callable(state):
            after_port.append([slot, encode(state(), out_bufs)])
    return {"args": after_args, "portables": after_port}


def _scalar_gradients(value: Tensor, flat: list, out_bufs: list[bytes]) -> list | None:
    """The gradient of a scalar ``value`` with respect to each leaf argument that requires one, as
    ``[index, encoded gradient]`` pairs (None: no such argument, or a graph that cannot be
    differentiated)."""
    leaves = [(i, a) for i, a in enumerate(flat) if isinstance(a, Tensor) and a.requires_grad and a.is_leaf]
    if not leaves:
        return None
    try:
        got = torch.autograd.grad(value.reshape(()), [a for _, a in leaves], allow_unused=True, retain_graph=True)
    except Exception:  # noqa: BLE001 - a graph that cannot be differentiated: no gradient
        return None
    return [[i, encode(g, out_bufs)] for (i, _), g in zip(leaves, got) if g is not None]


def _with_gradients(value: Tensor, grads: list, bufs: list[bytes], flat: list) -> Tensor:
    """``value`` joined to the autograd graph of the arguments it was computed from, with the
    gradients the learner's process computed: ``value + sum(((x - x.detach()) * g).sum())`` has the
    same value (the added term is exactly 0) and gradient ``g`` with respect to each ``x``."""
    out = value
    for item in grads:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and 0 <= item[0] < len(flat)):
            continue
        leaf, g = flat[item[0]], decode(item[1], bufs)
        if isinstance(leaf, Tensor) and leaf.requires_grad and isinstance(g, Tensor) and g.shape == leaf.shape:
            out = out + ((leaf - leaf.detach()) * g.to(leaf.dtype)).sum().to(out.dtype)
    return out


def _same(a: Tensor, b: Tensor) -> bool:
    if a.is_floating_point() or a.is_complex():
        both = torch.isnan(a) & torch.isnan(b)
        return bool(torch.equal(a.masked_fill(both, 0), b.masked_fill(both, 0)))
    return bool(torch.equal(a, b))


def _path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _resolve(spec: str) -> Any:
    """``"package.module:Qual.name"`` -> the object; only gptlab's own objects may be named."""
    module, _, qual = str(spec).partition(":")
    if not module.startswith("gptlab.") and module != "gptlab":
        raise ProtocolError(f"cannot build {spec!r} here")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _forbidden_from_specs(specs: list) -> list:
    out = []
    for spec in specs:
        try:
            target = resolve_forbidden(spec)
        except Exception:  # noqa: BLE001 - an entry this process lacks (another torch) cannot be called either
            continue
        out.append(Forbidden(target, str(spec[-1])))
    return out


def serve(address: str, token: str, namespace: dict) -> None:
    """Answer the autograder's requests about the learner's ``namespace`` until it says done.

    Runs in the learner's kernel, as the code of a cell the autograder executes there in place of a
    test cell. ``address`` is a Unix socket the trusted process listens on; ``token`` proves to it
    that this connection is the one it started.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    serve_socket(sock, token, namespace)


def serve_socket(sock: socket.socket, token: str, namespace: dict) -> None:
    """:func:`serve` on a connected socket (tests use a socket pair and a thread)."""
    worker = _Worker(namespace)
    try:
        _send(sock, {"op": "hello", "token": token}, [])
        while True:
            try:
                header, bufs = _recv(sock)
            except EOFError:
                return
            if header.get("op") == "done":
                return
            try:
                reply, out = worker.handle(header, bufs)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - report, keep serving
                reply, out = {"error": {"type": type(e).__name__, "message": str(e)}}, []
            try:
                _send(sock, reply, out)
            except ProtocolError as e:
                _send(sock, {"error": {"type": "TypeError", "message": str(e)}}, [])
    finally:
        with contextlib.suppress(Exception):
            sock.close()


# --------------------------------------------------------------------------- helpers for the checks


def accept(listener: socket.socket, token: str, deadline: float) -> socket.socket:
    """Wait (until ``deadline``) for the learner's kernel to connect and prove it is the one
    started for this test (its first message carries ``token``)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the learner's kernel did not connect")
        listener.settimeout(left)
        sock, _ = listener.accept()
        try:
            hello, _ = _recv(sock, min(deadline, time.monotonic() + 10))
        except (TimeoutError, EOFError, OSError, ProtocolError):
            sock.close()
            continue
        if hello.get("op") == "hello" and hello.get("token") == token:
            return sock
        sock.close()


def local_connection(namespace: dict, timeout: float | None = None) -> Connection:
    """A :class:`Connection` to a :func:`serve` loop over ``namespace`` in a thread of this process
    (for tests of the protocol and of the checks through it)."""
    import threading

    a, b = socket.socketpair()
    token = "local"
    thread = threading.Thread(target=serve_socket, args=(b, token, namespace), daemon=True)
    thread.start()
    hello, _ = _recv(a, time.monotonic() + 10)
    assert hello.get("token") == token
    deadline = None if timeout is None else time.monotonic() + timeout
    return Connection(a, deadline=deadline, limit_s=timeout)


def is_module(x: Any) -> bool:
    """``isinstance(x, nn.Module)``, for a local object or a learner's object behind a handle."""
    return bool(x._flags.get("is_module")) if isinstance(x, Remote) else isinstance(x, torch.nn.Module)


def is_module_class(x: Any) -> bool:
    """Whether ``x`` is a subclass of ``nn.Module`` (local, or a learner's class behind a handle)."""
    if isinstance(x, Remote):
        return bool(x._flags.get("is_module_class"))
    return isinstance(x, type) and issubclass(x, torch.nn.Module)


def isinstance_of(x: Any, cls: type) -> bool:
    """``isinstance(x, cls)`` for a class of torch or gptlab, local or behind a handle (by the
    qualified names of the object's classes)."""
    if isinstance(x, Remote):
        return f"{cls.__module__}.{cls.__qualname__}" in x._mro
    return isinstance(x, cls)


def load_params(module: Any, values: dict[str, Tensor]) -> None:
    """Copy ``values`` (state_dict name -> tensor) into the module's parameters and buffers."""
    if isinstance(module, Remote):
        module._conn.request("load", ref=module._ref, values=dict(values), label=module._label)
        return
    state = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in values.items():
            state[k].copy_(v.to(dtype=state[k].dtype, device=state[k].device))


def same_object(obj: Any, a: str, b: str) -> bool:
    """Whether the attribute paths ``a`` and ``b`` of ``obj`` are one object (a tied weight)."""
    if isinstance(obj, Remote):
        return bool(obj._conn.request("same", ref=obj._ref, a=a, b=b, label=obj._label))
    try:
        return _path(obj, a) is _path(obj, b)
    except (AttributeError, IndexError, TypeError):
        return False


def make(factory: Callable, *args: Any) -> Any:
    """``factory(*args)`` where the arguments live: here, or in the learner's process when one of
    them is a handle (``factory`` is one of gptlab's, named there by its module and qualified name)."""
    remote = next((a for a in args if isinstance(a, Remote)), None)
    if remote is None:
        return factory(*args)
    return remote._conn.request("make", factory=f"{factory.__module__}:{factory.__qualname__}", args=list(args),
                                label=factory.__qualname__)
