"""What README.md and docs/ name, checked against the tree, so that a page cannot
point at something that is gone: every `make` target, every relative link, every
path of the package, every `kvsvc` command and `kvsvc serve` flag in a code block.
deploy/ and docker/ are held to the same paths (their comments name modules)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from kvsvc.server.config import SETTINGS

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: every text file of deploy/ and docker/ (manifests, compose, Dockerfile, READMEs)
DEPLOY = [
    p
    for d in ("deploy", "docker")
    for p in sorted((REPO / d).rglob("*"))
    if p.is_file() and "wheels" not in p.parts and p.suffix in {".md", ".yaml", ".json", ""}
]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def code_blocks(text: str, langs: tuple[str, ...] = ("bash", "sh")) -> list[str]:
    return [
        body
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
        if lang in langs
    ]


def test_every_make_target_the_docs_name_exists() -> None:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    missing = {
        (rel(page), target)
        for page in [*PAGES, REPO / "deploy" / "README.md", REPO / "docker" / "README.md"]
        for target in re.findall(r"`make ([a-z][\w-]*)", page.read_text())
        if target not in targets
    }
    assert missing == set()


def test_every_relative_link_of_the_docs_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append((rel(page), target))
    assert broken == []


def test_every_package_path_the_docs_and_deploy_files_name_exists() -> None:
    """`kvsvc/server/config/settings.py`, `kvsvc/server/data/native/copyloop.c`: a path
    of the package named anywhere in the docs, manifests, compose file or Dockerfile
    (comments included) is one the tree has."""
    stale = []
    for page in [*PAGES, *DEPLOY]:
        for path in re.findall(r"(?<![\w./-])(kvsvc/[\w/]+\.(?:py|c|h|json))", page.read_text()):
            if not (REPO / path).exists():
                stale.append((rel(page), path))
    assert stale == []


def test_every_kvsvc_command_in_the_docs_is_one_the_cli_has() -> None:
    """Each `kvsvc SUBCOMMAND` line of a shell block names a subcommand that exists;
    each flag of a `kvsvc serve` line is a setting (or serve's own --config, --check,
    --print-config)."""
    cli = "".join(p.read_text() for p in sorted((REPO / "kvsvc" / "cli").glob("*.py")))
    commands = set(re.findall(r'add_parser\(\s*"([\w-]+)"', cli))
    assert {"serve", "demo", "stats", "init-auth"} <= commands
    serve_flags = {s.flag for s in SETTINGS.values()} | {"--config", "--check", "--print-config"}
    serve_flags |= {f"--no-{s.flag[2:]}" for s in SETTINGS.values()}
    seen, bad = 0, []
    for page in PAGES:
        for block in code_blocks(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                try:  # a line of a longer quoted argument: its words as written
                    words = shlex.split(line.split(" #")[0])
                except ValueError:
                    words = line.split()
                for i, word in enumerate(words[:-1]):
                    if not (word == "kvsvc" or word.endswith("/kvsvc")):
                        continue
                    seen += 1
                    sub = words[i + 1]
                    if sub not in commands:
                        bad.append((rel(page), line))
                    elif sub == "serve":
                        flags = {w.split("=")[0] for w in words[i + 2 :] if w.startswith("--")}
                        bad += [(rel(page), f) for f in flags - serve_flags]
    assert seen >= 5, "the docs show kvsvc commands"
    assert bad == []


def test_the_readme_two_commands_say_what_they_do() -> None:
    """`make serve`'s address and store size are the defaults; `make test`'s list is
    exactly the Makefile's test prerequisites."""
    readme = (REPO / "README.md").read_text()
    serve = re.search(r"^make serve +#.* serves on (\S+) \(CPU store, (\d+) MiB\)$", readme, re.M)
    assert serve, "README's make serve line"
    assert SETTINGS["listen"].default == serve[1]
    assert SETTINGS["store_bytes"].default == int(serve[2]) << 20
    line = re.search(r"^make test +# installs, then runs every check: (.*)$", readme, re.M)
    assert line, "README's make test line"
    alias = {"ruff": "lint", "mypy": "typecheck", "proto drift": "check-proto"}
    alias["container"] = "test-container"
    named = {alias.get(n.strip(), n.strip()) for n in line[1].split(",")}
    makefile = (REPO / "Makefile").read_text()
    test = re.search(r"^test:(.*)$", makefile, re.M)
    assert test and named == set(test[1].split()) - {"install"}
