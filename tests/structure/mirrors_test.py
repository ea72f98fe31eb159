#!/usr/bin/env python3
"""Values each language must spell for itself, checked against the one they come from.

The element types (DType) are numbered by proto/gpufeed/v1/feed.proto; the C++ enum
(client/cpp/include/gpufeed/dtype.h) with its names (common/dtype.cc), the C ABI's
gpufeed_dtype (client/c/include/gpufeed/gpufeed.h) and the Python client's DTYPES
(client/python/src/gpufeed/client.py) must carry the same names with the same numbers, and
the Python pipeline's cast names must be proto names. The largest pipeline size is the
daemon's kMaxPipelineSide (server/augment/pipeline.h), which the Python pipeline repeats to
refuse a request before sending it. The Python client's string choices (typing.Literal
types: kind, delivery, ipc, decode, augment, bad_sample, elastic, pack, layout) are the names of
the proto's enums (less a common prefix: ELASTIC_KEEP_GLOBAL_BATCH is "global_batch"), and the C++ client (which the C library serves) spells each of them. Each mismatch is
named with the files on both sides.

    python3 tests/structure/mirrors_test.py [ROOT]
"""

import ast
import os
import re
import sys

PROTO = "proto/gpufeed/v1/feed.proto"
CPP = "client/cpp/include/gpufeed/dtype.h"
CPP_NAMES = "common/dtype.cc"
C = "client/c/include/gpufeed/gpufeed.h"
PY = "client/python/src/gpufeed/client.py"
PY_PIPELINE = "client/python/src/gpufeed/pipeline.py"
CPP_OPTIONS = ("client/cpp/options.cc", "client/cpp/pipeline_json.cc", "client/cpp/blend.cc")
# Python Literal type (file, name) -> (proto enum, the choice its UNSPECIFIED value stands
# for, or None when it is no choice[, the values' prefix when it is not the enum's name]).
CHOICES = {
    (PY, "Kind"): ("DatasetKind", None),
    (PY, "Delivery"): ("DeliveryKind", None),
    (PY, "Ipc"): ("IpcKind", "auto"),
    (PY, "Decode"): ("ImageDecode", None),
    (PY, "Augment"): ("ImageAugment", None),
    (PY, "BadSample"): ("BadSamplePolicy", None),
    (PY, "Elastic"): ("Elastic", None, "ELASTIC_KEEP_"),
    (PY, "Pack"): ("PackMode", None),
    (PY_PIPELINE, "Layout"): ("ImageLayout", None),
}
LIMIT = "server/augment/pipeline.h"
LIMIT_USE = "server/augment/pipeline.cc"


def read(root, path):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return f.read()


def block(text, start, path):
    """The text from `start` to the first closing brace after it, comments left out."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    at = text.find(start)
    if at < 0:
        raise SystemExit(f"{path}: no `{start}`: update tests/structure/mirrors_test.py")
    return text[at:text.index("}", at)]


def python_assignment(text, name, path):
    for node in ast.parse(text).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"{path}: no `{name} = ...`: update tests/structure/mirrors_test.py")


def compare(errors, want, got, where):
    """`want` and `got`: {lower-case name: number}; `where`: "A vs B" for the messages."""
    for name, number in sorted(want.items(), key=lambda kv: kv[1]):
        if name not in got:
            errors.append(f"{where}: {name} = {number} is missing from the second")
        elif got[name] != number:
            errors.append(f"{where}: {name} is {number} in the first, {got[name]} in the second")
    for name, number in sorted(got.items(), key=lambda kv: kv[1]):
        if name not in want:
            errors.append(f"{where}: {name} = {number} is not in the first")


def dtype_errors(root):
    errors = []
    proto = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(
        r"\bDTYPE_(\w+)\s*=\s*(\d+)\s*;", block(read(root, PROTO), "enum DType {", PROTO))}
    if not proto:
        return [f"{PROTO}: enum DType has no values"]
    cpp = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(
        r"\bk(\w+)\s*=\s*(\d+)\s*,", block(read(root, CPP), "enum class DType", CPP))}
    compare(errors, proto, cpp, f"{PROTO} DType vs {CPP} DType")
    # Every type but unspecified has its printed name, the enum's own name in lower case.
    names = {m.group(1).lower(): m.group(2) for m in re.finditer(
        r'\{DType::k(\w+),\s*"([^"]*)"\}', read(root, CPP_NAMES))}
    compare(errors, {n: n for n in proto if n != "unspecified"},
            {enum: name for enum, name in names.items()}, f"{PROTO} DType vs {CPP_NAMES} names")
    # The C ABI has no unspecified value: a tensor always has a type.
    c = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(
        r"\bGPUFEED_DTYPE_(\w+)\s*=\s*(\d+)", block(read(root, C), "typedef enum gpufeed_dtype", C))}
    compare(errors, {n: v for n, v in proto.items() if n != "unspecified"}, c,
            f"{PROTO} DType vs {C} gpufeed_dtype")
    py = {name: number for number, (name, _) in
          python_assignment(read(root, PY), "DTYPES", PY).items()}
    compare(errors, {n: v for n, v in proto.items() if n != "unspecified"}, py,
            f"{PROTO} DType vs {PY} DTYPES")
    casts = python_assignment(read(root, PY_PIPELINE), "_DTYPES", PY_PIPELINE)
    for name, proto_name in casts.items():
        if proto_name != "DTYPE_" + name.upper() or name not in proto:
            errors.append(f"{PY_PIPELINE} _DTYPES: {name!r} -> {proto_name!r} is not "
                          f"{PROTO}'s DTYPE_{name.upper()}")
    return errors


def python_literal(text, name, path):
    """The values of `name = Literal[...]`."""
    for node in ast.parse(text).body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                 for t in node.targets)
                and isinstance(node.value, ast.Subscript)):
            values = node.value.slice
            elements = values.elts if isinstance(values, ast.Tuple) else [values]
            return [ast.literal_eval(e) for e in elements]
    raise SystemExit(f"{path}: no `{name} = Literal[...]`: update tests/structure/mirrors_test.py")


def choice_errors(root):
    errors = []
    proto = read(root, PROTO)
    cpp = "".join(read(root, path) for path in CPP_OPTIONS)
    for (path, name), (enum, unspecified, *named_prefix) in CHOICES.items():
        values = re.findall(r"\b([A-Z0-9_]+)\s*=\s*\d+\s*;", block(proto, f"enum {enum} {{", PROTO))
        prefix = (named_prefix[0] if named_prefix
                  else re.sub(r"(?<!^)(?=[A-Z])", "_", enum).upper() + "_")
        want = set()
        for value in values:
            choice = value[len(prefix):].lower()
            if choice == "unspecified":
                choice = unspecified
            if choice is not None:
                want.add(choice)
        got = set(python_literal(read(root, path), name, path))
        for choice in sorted(want - got):
            errors.append(f"{PROTO} {enum} vs {path} {name}: {choice!r} is missing from the "
                          "second")
        for choice in sorted(got - want):
            errors.append(f"{PROTO} {enum} vs {path} {name}: {choice!r} is not in the first")
        for choice in sorted(got & want):
            if f'"{choice}"' not in cpp:
                errors.append(f"{path} {name}: {choice!r} is spelled nowhere in "
                              f"{' or '.join(CPP_OPTIONS)}")
    layouts = python_assignment(read(root, PY_PIPELINE), "_LAYOUTS", PY_PIPELINE)
    literal = python_literal(read(root, PY_PIPELINE), "Layout", PY_PIPELINE)
    if sorted(layouts) != sorted(literal) or any(
            v != "IMAGE_LAYOUT_" + k.upper() for k, v in layouts.items()):
        errors.append(f"{PY_PIPELINE}: _LAYOUTS {layouts} is not Layout {literal} mapped to "
                      "IMAGE_LAYOUT_ names")
    return errors


def limit_errors(root):
    errors = []
    m = re.search(r"\bkMaxPipelineSide\s*=\s*(\d+)\s*;", read(root, LIMIT))
    if m is None:
        return [f"{LIMIT}: no kMaxPipelineSide: update tests/structure/mirrors_test.py"]
    daemon = int(m.group(1))
    python = python_assignment(read(root, PY_PIPELINE), "_MAX_SIDE", PY_PIPELINE)
    if python != daemon:
        errors.append(f"{PY_PIPELINE} _MAX_SIDE is {python}, {LIMIT} kMaxPipelineSide is "
                      f"{daemon}")
    if str(daemon) in read(root, LIMIT_USE):
        errors.append(f"{LIMIT_USE} spells {daemon} itself: use kMaxPipelineSide")
    return errors


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    errors = dtype_errors(root) + choice_errors(root) + limit_errors(root)
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} mismatch(es): the first file named is the source of truth")
        return 1
    print("mirrors: DType in 5 places, the Python choices and the pipeline's size limit agree")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
