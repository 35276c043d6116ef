"""What a reader of each script meets: lines, characters, the share of words around the code, and the names from
`ladder` to look up (issue 65's table). Reads the files of a git revision (default: the working tree) and prints one
markdown table with the command.

    python benchmarks/reading.py                  # this checkout
    python benchmarks/reading.py --revs d2f7c54 HEAD

Counted as issue 65 counts them:
- density: (comment lines + docstring lines, tyro's attribute docstrings included + code lines that carry an inline
  comment) / code lines (non-blank lines that are neither comments nor docstrings);
- ladder names: every name imported from `ladder`, plus every distinct attribute the script reads or calls on a ladder
  object: `run.x` (the `Run` of `with Run(...) as run`), `optimizer.x` beyond torch.optim.Optimizer's public API
  (and its `step` called with a gradient), and an attribute of an imported ladder name (`CudaGraph.devices`).
"""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
import tokenize
from dataclasses import dataclass

import tyro

SCRIPTS = ["reinforce.py", "vpg.py", "ppo_cartpole_gpu.py", "ppo_atari_envpool.py", "ppo_mujoco_brax.py"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIMIZER_API = {
    "param_groups", "state", "defaults", "step", "zero_grad", "state_dict", "load_state_dict", "add_param_group",
    "register_step_pre_hook", "register_step_post_hook", "register_state_dict_pre_hook",
    "register_state_dict_post_hook", "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook",
}  # fmt: skip


@dataclass
class Args:
    revs: tuple[str, ...] = ()
    """git revisions to read (none: the working tree)"""


def source(rev: str | None, path: str) -> str:
    if rev is None:
        with open(os.path.join(ROOT, path)) as f:
            return f.read()
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def docstring_lines(tree: ast.Module) -> set[int]:
    """The lines of every docstring: a string statement first in a module, class or function, or after an assignment
    in a class body (tyro reads those as the flags' help)."""
    lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, statement in enumerate(body):
            string = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            string = string and isinstance(statement.value.value, str)
            first = i == 0 and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            after_field = (
                i > 0 and isinstance(node, ast.ClassDef) and isinstance(body[i - 1], (ast.AnnAssign, ast.Assign))
            )
            if string and (first or after_field):
                lines |= set(range(statement.lineno, statement.end_lineno + 1))
    return lines


def density(text: str) -> tuple[float, int, int]:
    """(words-around-code ratio, comment + docstring + inline-comment lines, code lines)."""
    docs = docstring_lines(ast.parse(text))
    comments, inline = set(), set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            line = token.start[0]
            (comments if not token.line[: token.start[1]].strip() else inline).add(line)
    lines = text.splitlines()
    code = {i for i, line in enumerate(lines, 1) if line.strip() and i not in comments and i not in docs}
    words = len(comments) + len(docs) + len(inline & code)
    return words / len(code), words, len(code)


def ladder_names(text: str) -> list[str]:
    """The names from `ladder` a reader of the script looks up (the module docstring says how they are counted)."""
    tree = ast.parse(text)
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ladder"
        for alias in node.names
    }
    runs, optimizers = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.withitem) and isinstance(node.context_expr, ast.Call):
            if getattr(node.context_expr.func, "id", None) == "Run" and isinstance(node.optional_vars, ast.Name):
                runs.add(node.optional_vars.id)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1:
            made = getattr(node.value.func, "id", "")  # an instance of a ladder class (Adam)
            if made in imported and made[:1].isupper() and made != "Run" and isinstance(node.targets[0], ast.Name):
                optimizers.add(node.targets[0].id)
    names = set(imported)
    for node in ast.walk(tree):  # torch's step(closure=None) called with a gradient: a ladder-only signature
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "step"
            and node.args
        ):
            if isinstance(node.func.value, ast.Name) and node.func.value.id in optimizers:
                names.add(f"{node.func.value.id}.step")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, attr = node.value.id, node.attr
            if owner in runs or owner in imported:
                names.add(f"{owner}.{attr}")
            elif owner in optimizers and attr not in OPTIMIZER_API:
                names.add(f"{owner}.{attr}")
    return sorted(names)


def main(args: Args) -> None:
    revs = list(args.revs) or [None]
    print(f"`python benchmarks/reading.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print()
    print("| script | revision | lines | characters | density | ladder names | the names |")
    print("|---|---|---|---|---|---|---|")
    for script in SCRIPTS:
        for rev in revs:
            text = source(rev, script)
            ratio, _, _ = density(text)
            names = ladder_names(text)
            label = rev or "working tree"
            print(f"| {script} | {label} | {len(text.splitlines())} | {len(text):,} | {ratio:.2f} | {len(names)} | "
                  f"{', '.join(names)} |")  # fmt: skip


if __name__ == "__main__":
    main(tyro.cli(Args))
