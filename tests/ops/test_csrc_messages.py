"""Every value in a compiled error message is text made by lamp::num / lamp::dims, or a string, a dtype,
a device or a layout: never an integer, a shape or a tensor streamed by c10::str.

Why (benchmarks/gpu/f667cf8, an H200 with the extension built by the image's /opt/gcc g++): every
bad-input message that streamed a number (a shape, a stride, a list length) killed the process with
SIGSEGV, 28 CUDA cases; every message without one raised as it should. A CPU machine does not crash, so
this reads the sources: a new message that streams a number fails here, not on the next GPU.
"""
import pathlib
import re

import pytest

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
CHECK = re.compile(r"\b(TORCH_CHECK(?:_VALUE|_TYPE|_INDEX|_NOT_IMPLEMENTED)?|TORCH_INTERNAL_ASSERT)\s*\(")

# Values that print as words: string variables (names, modes, reasons), dtypes and devices.
WORD_VARIABLES = {
    "op", "name", "name_a", "name_b", "what", "pn", "gn", "sn", "cn", "mode", "g_mode", "why", "policy",
    "dtype", "(dtype)", "pdtype", "gdtype", "device", "::lamp::kKernelDevices", "#expr",
    "path",  # a std::string: the wgrad path a caller named (cpu/wgrad_gemm.cpp)
}
WORD_FORMS = [
    r'"(?:[^"\\]|\\.)*"',  # a string literal
    r"(?:::lamp::)?(?:num|dims)\(.*\)",  # text made without a stream
    r".*(?:\.|->)(?:device|scalar_type|layout)\(\)",  # printed by c10 as words ("cuda:0" by libc10 itself)
    r"(?:at_index|path_name|cublasGetStatusString)\(.*\)",  # functions returning strings
]


def _arguments(text, start):
    """The top-level comma-separated arguments of the call whose '(' ends at start."""
    depth, i, current, out, quote = 1, start, "", [], None
    while depth:
        c = text[i]
        if quote:
            current += c
            if c == "\\":
                current += text[i + 1]
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote, current = c, current + c
        elif c in "([{":
            depth, current = depth + 1, current + c
        elif c in ")]}":
            depth -= 1
            current += c if depth else ""
        elif c == "," and depth == 1:
            out.append(current.strip())
            current = ""
        else:
            current += c
        i += 1
    return out + [current.strip()]


def _message_values():
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh"):
            continue
        text = path.read_text().replace("\\\n", " ")
        for match in CHECK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            for value in _arguments(text, match.end())[1:]:  # the first is the condition
                yield f"{path.relative_to(CSRC)}:{line}", re.sub(r"\s+", " ", value)


def _is_word(value):
    return value in WORD_VARIABLES or any(re.fullmatch(form, value) for form in WORD_FORMS)


def test_the_scan_finds_the_messages():
    values = list(_message_values())
    assert len(values) > 150
    assert any(v == "dims(main_grad.sizes())" for _, v in values)


@pytest.mark.parametrize("value,word", [
    ("t.sizes()", False), ("src.size()", False), ("i", False), ("(t).strides()", False), ("numel", False),
    ("dims(t.sizes())", True), ("::lamp::num(v)", True), ('"a, b"', True), ("t->device()", True),
    ("op", True),
])
def test_the_rule_tells_numbers_from_words(value, word):
    assert _is_word(value) is word


def test_no_compiled_message_streams_a_number():
    streamed = [f"{where}: {value}" for where, value in _message_values() if not _is_word(value)]
    assert not streamed, ("these message values are streamed by c10::str; wrap numbers and shapes in "
                          "lamp::num / lamp::dims (csrc/checks.h), or name a word-valued variable in "
                          "WORD_VARIABLES:\n" + "\n".join(streamed))
