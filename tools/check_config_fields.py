"""Fail when a field of a frozen config dataclass is read nowhere in the library.

    python tools/check_config_fields.py [package ...]     # default: the four library packages

The config classes are the ``@dataclass(frozen=True)`` classes defined in ``mok_core`` (today
``MoKConfig``, ``LayerShape``, ``GemmConfig``). A field counts as read when, outside its own
class body, the library packages hold an attribute access ``.field``, a
``getattr(obj, "field")``, or a ``field=`` keyword to a call other than the class itself or
``replace`` (those set a field, they do not read it); inside the class, a read in one of its
methods counts (``MoKConfig.schedule_capacity``), ``__post_init__``'s checks do not. Reads inside functions whose name
contains "fingerprint" or "digest" do not count: a field that only feeds the ranks' agreement
check changes nothing the layer does. Matching is by name, so a field named like another
object's attribute may pass unnoticed; it never flags a field that is read. Tests and
benchmarks do not count: a field only they read is not part of the library.
Exit 1 naming every unread field; stdlib only.
"""
from __future__ import annotations

import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("mok_core", "mok_comm", "mok_torch", "mok_jax_adapter")
CONFIG_PACKAGE = "mok_core"
BOOKKEEPING = re.compile(r"fingerprint|digest", re.I)


def py_files(package):
    for d, dirs, files in os.walk(os.path.join(ROOT, package)):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(d, f)


def parse(path):
    with open(path) as f:
        return ast.parse(f.read(), path)


def is_frozen_dataclass(cls):
    for d in cls.decorator_list:
        if isinstance(d, ast.Call):
            name = d.func.attr if isinstance(d.func, ast.Attribute) else getattr(d.func, "id", "")
            if name == "dataclass" and any(k.arg == "frozen" and getattr(k.value, "value", 0) is True
                                           for k in d.keywords):
                return True
    return False


def config_classes():
    """{class name: (path, lineno, end_lineno, {field: lineno})} of mok_core's frozen dataclasses."""
    out = {}
    for path in py_files(CONFIG_PACKAGE):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ClassDef) and is_frozen_dataclass(node):
                fields = {s.target.id: s.lineno for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                          and "ClassVar" not in ast.unparse(s.annotation)}
                out[node.name] = (path, node.lineno, node.end_lineno, fields)
    return out


def reads(path, tree, classes, names):
    """Field names read in one file (not by validation or bookkeeping)."""
    own = [(lo, hi) for p, lo, hi, _ in classes.values() if p == path]
    found = set()

    def visit(node, func):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        line = getattr(node, "lineno", None)
        inside = line is not None and any(lo <= line <= hi for lo, hi in own)
        # in its own class only a method's read counts (a helper like schedule_capacity);
        # the field list, __post_init__'s checks and other dunders are not uses
        skip = (inside and (not func or func.startswith("__"))) or BOOKKEEPING.search(func)
        if not skip:
            if isinstance(node, ast.Attribute) and node.attr in names \
                    and isinstance(node.ctx, ast.Load):
                found.add(node.attr)
            elif isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) \
                    else getattr(node.func, "id", "")
                if callee == "getattr" and len(node.args) > 1 \
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value in names:
                    found.add(node.args[1].value)
                if callee not in classes and callee != "replace":
                    found.update(k.arg for k in node.keywords if k.arg in names)
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "")
    return found


def main(argv=None):
    packages = tuple(argv if argv else sys.argv[1:]) or PACKAGES
    classes = config_classes()
    names = {f for _, _, _, fields in classes.values() for f in fields}
    read = set()
    for package in packages:
        for path in py_files(package):
            read |= reads(path, parse(path), classes, names)
    unread = [(os.path.relpath(p, ROOT), line, cls, f)
              for cls, (p, _, _, fields) in sorted(classes.items())
              for f, line in fields.items() if f not in read]
    for path, line, cls, f in unread:
        print(f"{path}:{line}: {cls}.{f} is read nowhere in {', '.join(packages)} "
              "outside its class: use it or remove it")
    if not unread:
        print(f"config fields: every field of {', '.join(sorted(classes))} is read")
    return 1 if unread else 0


if __name__ == "__main__":
    sys.exit(main())
