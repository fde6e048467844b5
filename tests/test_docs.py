"""
Every repository path that README.md and docs/*.md name exists, so that a rename or a removal shows in the docs.

Which names are paths:

- a word of an inline code span (`ppo/collection.py`, `--ours-conf-file hyperparams/sac_fast.yml`) that is made of
  letters, digits and ``_.-/`` only, contains a ``/`` and ends in a file extension or a ``/`` (a folder): so flags
  (``-f/--log-folder``), maths (``1/n``), URLs, globs and placeholders (``logs/<algo>/``) are not paths;
- such a word followed by ``::name`` is a pytest node id: the file must also define the test ``name``;
- a dotted name starting with ``sb3_speedups.`` in a code span (``sb3_speedups.dqn.replay.buffers``): it must import,
  as a module or a module's attribute;
- the target of a relative markdown link (``[maths](docs/maths.md)``), from the document's folder;
- every entry of the tree block of docs/architecture.md (the fenced block that starts with ``sb3_speedups/``): its path
  is built from the entries above it by indentation, under ``sb3_speedups/``.

Fenced blocks other than that tree (commands, YAML, Python) are not read, and a bare file name without a folder
(``config.yml``, ``gru.py`` beside its folder's entry) is not a path: it names a file of a run or of the context.

How a path resolves: relative to the repository root, else relative to ``sb3_speedups/`` (the docs write
``ppo/collection.py`` for ``sb3_speedups/ppo/collection.py``); a path whose first folder is neither in the repository
root nor in ``sb3_speedups/`` but is another installed package (``stable_baselines3/ppo/ppo.py``) resolves inside that
package. A path ending in ``/`` must be a folder.

Not repository paths, by rule: the outputs of a run, under the CLI's default ``--log-folder`` (``logs/``), and names
with a ``<placeholder>``. A name that no longer exists (history in docs/benchmarks.md) is written without backticks.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sb3_speedups.cli import add_train_arguments

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sb3_speedups"

FENCE = re.compile(r"^[ \t]*(```+)[^\n]*\n(.*?)^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)
# A CommonMark code span: a run of backticks, closed by the next run of the same length.
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
PATH_WORD = re.compile(r"(?P<path>[A-Za-z0-9_.][A-Za-z0-9_.\-/]*/[A-Za-z0-9_.\-/]*)(?:::(?P<test>\w+)(?:\[.*\])?)?")
FILE_OR_FOLDER = re.compile(r"(\.[A-Za-z]+|/)$")
DOTTED = re.compile(r"sb3_speedups(\.\w+)+")
LINK = re.compile(r"\]\(([^)\s]+)\)")
URL = re.compile(r"^[a-z][a-z0-9+.-]*:")


@dataclass(frozen=True)
class Reference:
    """A name a document gives, and where."""

    doc: str
    name: str
    kind: str  # "path", "dotted", "link" or "tree"
    test: str | None = None


def documents() -> list[Path]:
    """:return: README.md and every docs/*.md"""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def run_output_folder() -> str:
    """:return: the CLI's default ``--log-folder``, under which the docs name files a run writes (``logs/``)"""
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return f"{parser.get_default('log_folder').rstrip('/')}/"


def tree_entries(block: str) -> Iterator[str]:
    """
    :param block: the tree block of docs/architecture.md
    :return: the path of each entry (``sb3_speedups/common/nn/mlp.py``); a line indented more than two spaces past
        the innermost open folder continues the description above it and names nothing
    """
    folders: list[tuple[int, str]] = []  # (indentation, path) of the open folders, outermost first
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        while folders and indent <= folders[-1][0]:
            folders.pop()
        if folders and indent > folders[-1][0] + 2:
            continue
        name = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        path = f"{folders[-1][1]}{name}" if folders else name
        yield path
        if name.endswith("/"):
            folders.append((indent, path))


def references(doc: Path, root: Path = ROOT) -> Iterator[Reference]:
    """
    :param doc: a markdown file
    :param root: the folder its links are relative to (its labels too)
    :return: every name in ``doc`` that the rules of the module docstring make a repository path
    """
    text = doc.read_text()
    label = str(doc.relative_to(root))
    for fence in FENCE.finditer(text):
        if fence.group(2).startswith("sb3_speedups/"):
            for path in tree_entries(fence.group(2)):
                yield Reference(label, path, "tree")
    prose = FENCE.sub("", text)
    outputs = run_output_folder()
    for _, span in CODE_SPAN.findall(prose):
        for word in span.split():
            match = PATH_WORD.fullmatch(word)
            if match and FILE_OR_FOLDER.search(match["path"]) and not match["path"].startswith(outputs):
                yield Reference(label, match["path"], "path", match["test"])
            elif DOTTED.fullmatch(word):
                yield Reference(label, word, "dotted")
    for target in LINK.findall(prose):
        if not URL.match(target) and not target.startswith("#"):
            yield Reference(label, str((doc.parent / target.split("#")[0]).resolve().relative_to(root)), "link")


def resolve(name: str) -> Path | None:
    """:return: the file or folder ``name`` names (see the module docstring), or ``None`` if there is none"""
    folder = name.endswith("/")
    candidates = [ROOT / name, PACKAGE / name]
    first = name.split("/")[0]
    ours = (ROOT / first).exists() or (PACKAGE / first).exists()
    spec = None if ours or not first.isidentifier() else importlib.util.find_spec(first)
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(next(iter(spec.submodule_search_locations))).parent / name)
    for path in candidates:
        if path.is_dir() if folder else path.exists():
            return path
    return None


def imports(dotted: str) -> bool:
    """
    :return: whether ``dotted`` is a module (found without importing it, so a module of an optional extra counts) or an
        attribute of one
    """
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module = ".".join(parts[:split])
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent is a module, not a package
            found = False
        if not found:
            continue
        obj = importlib.import_module(module) if split < len(parts) else None
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def problem(ref: Reference) -> str | None:
    """:return: what is wrong with ``ref``, or ``None``"""
    if ref.kind == "dotted":
        return None if imports(ref.name) else "does not import"
    path = resolve(ref.name)
    if path is None:
        where = "under sb3_speedups/" if ref.kind == "tree" else "from the repository root or sb3_speedups/"
        return f"no such {'folder' if ref.name.endswith('/') else 'file'} {where}"
    if ref.test is not None and not re.search(rf"^(async )?def {ref.test}\(", path.read_text(), re.MULTILINE):
        return f"{path.relative_to(ROOT)} defines no test {ref.test}"
    return None


def test_every_path_the_docs_name_exists():
    missing = [
        f"{ref.doc}: {ref.name}{'::' + ref.test if ref.test else ''} ({ref.kind}): {reason}"
        for doc in documents()
        for ref in dict.fromkeys(references(doc))
        if (reason := problem(ref)) is not None
    ]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_rules_find_the_docs_paths():
    """The rules above still see the docs' paths (a change that made them see none would pass the test above)."""
    found = {doc.name: {ref.kind for ref in references(doc)} for doc in documents()}
    assert {"path", "dotted", "link"} <= found["README.md"]
    assert {"path", "tree", "link"} <= found["architecture.md"]
    assert any(ref.test for ref in references(ROOT / "docs" / "maths.md"))


def test_tree_entries_follow_indentation_and_skip_wrapped_descriptions():
    block = "sb3_speedups/\n  a/\n    b.py          one\n                  wrapped: c.py\n  d.py\n  e/            two\n"
    assert list(tree_entries(block)) == [
        "sb3_speedups/",
        "sb3_speedups/a/",
        "sb3_speedups/a/b.py",
        "sb3_speedups/d.py",
        "sb3_speedups/e/",
    ]


def test_names_that_are_not_repository_paths_are_left_out(tmp_path: Path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "`-f/--log-folder` `1/n` `logs/ppo/CartPole-v1_1/CartPole-v1.zip` `<rl-zoo>/hyperparams/ppo.yml` `my_space.yml` "
        "`https://docs.ray.io` `rl_zoo3/hyperparams/*.yml` [ray](https://docs.ray.io) [top](#top)\n"
        "```bash\nsb3-speedups train -conf hyperparams/nothing.yml\n```\n"
    )
    assert list(references(doc, root=tmp_path)) == []
