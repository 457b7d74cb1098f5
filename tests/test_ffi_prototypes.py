"""jaxcomm/_ffi.py's ctypes prototypes (``C_FUNCTIONS``) against the C++ sources: every function
the library exports with C linkage has a row, and each row's types are the declared ones.

The sources are the compiler-checked truth; this test reads each exported definition
(``JAXCOMM_C_API`` or ``visibility("default")`` inside ``extern "C"``) under ffi/ and maps its
C types to ctypes, so a prototype that drifts from the C++ fails here instead of corrupting
arguments at run time.
"""

from __future__ import annotations

import ctypes
import re

from conftest import REPO_ROOT

from jaxcomm import _ffi

_EXPORT = re.compile(
    r'(?:JAXCOMM_C_API|__attribute__\(\(visibility\("default"\)\)\))\s+'
    r"(?P<ret>[\w\s\*]+?)\s*\b(?P<name>jaxcomm_\w+)\s*\((?P<args>[^)]*)\)\s*\{",
    re.DOTALL,
)

_SCALARS = {
    "void": None,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "double": ctypes.c_double,
    "JaxcommRegistration": _ffi._Registration,
}


def ctype_of(declaration: str) -> object:
    """The ctypes type of a C parameter or return type (its name, if any, dropped).

    ``char*`` is ``c_char_p`` and ``void*`` is ``c_void_p``, as ctypes passes them; any other
    pointer is ``POINTER`` of what it points to.
    """
    text = re.sub(r"\bconst\b", " ", declaration).replace("*", " * ")
    words = text.split()
    if len(words) > 1 and words[-1] != "*" and words[-1] not in _SCALARS:
        words = words[:-1]  # the parameter's name
    base, stars = words[0], words.count("*")
    if base == "char" and stars:
        return _pointer(ctypes.c_char_p, stars - 1)
    if base == "void" and stars:
        return _pointer(ctypes.c_void_p, stars - 1)
    return _pointer(_SCALARS[base], stars)


def _pointer(base: object, depth: int) -> object:
    for _ in range(depth):
        base = ctypes.POINTER(base)
    return base


def exported_functions() -> dict[str, tuple[object, list[object]]]:
    """name -> (restype, argtypes) of every C function the sources under ffi/ export."""
    found = {}
    for path in sorted((REPO_ROOT / "ffi").rglob("*")):
        if path.suffix not in (".cc", ".h", ".cu"):
            continue
        for m in _EXPORT.finditer(path.read_text()):
            args = [a for a in m["args"].split(",") if a.strip() and a.strip() != "void"]
            found[m["name"]] = (ctype_of(m["ret"]), [ctype_of(a) for a in args])
    return found


def test_the_parser_reads_a_definition():
    source = "JAXCOMM_C_API int64_t jaxcomm_x(const char* blob, const int64_t* lengths) {"
    (m,) = _EXPORT.finditer(source)
    assert m["name"] == "jaxcomm_x"
    assert ctype_of(m["ret"]) is ctypes.c_int64
    assert [ctype_of(a) for a in m["args"].split(",")] == [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_int64),
    ]


def test_every_exported_function_has_its_declared_prototype():
    exported = exported_functions()
    assert len(exported) >= 10, sorted(exported)
    assert sorted(_ffi.C_FUNCTIONS) == sorted(exported)
    wrong = {
        name: (row, exported[name])
        for name, row in _ffi.C_FUNCTIONS.items()
        if (row[0], list(row[1])) != exported[name]
    }
    assert wrong == {}


def test_a_json_reader_whose_text_grew_between_calls_is_read_again(monkeypatch):
    # The metrics grow while collectives finish on the engine's thread: the text the second
    # call copies can be longer than the size the first returned. The C function then
    # returns the full length (>= the capacity), and the reader asks again.
    texts = iter(['{"a": 1}', '{"a": 1, "b": 2}', '{"a": 1, "b": 2}'])

    def reader(buffer, capacity):
        text = next(texts).encode()
        if buffer is not None:
            ctypes.memmove(buffer, text[: capacity - 1], min(len(text), capacity - 1))
        return len(text)

    monkeypatch.setattr(_ffi, "library", lambda: type("Lib", (), {"grows": reader}))
    assert _ffi.read_json("grows") == {"a": 1, "b": 2}
