"""Check that the documents' cross-references, links and command lines match the documents and
the CLI.

    python scripts/check_docs.py [FILE.md|DIR ...]

The documents are README.md and every docs/**/*.md by default, else the files named (a folder:
every *.md under it). Three checks, one line per problem naming file:line, exit 1 if there is
any:

- **Sections.** A reference in prose — `see Scheduling`, `(see Resume)`, `see Servers and
  Data quality` — must name a `#`, `##` or `###` heading of any of the documents (a page's
  title is its `#`): the heading must start with the referenced words (case-insensitive,
  punctuation ignored), so `see Servers` matches `# Servers: profiles, launch and the
  quality policy`. A reference is the text after "see" from its first capitalised word up
  to the next punctuation mark; "and" joins several.
- **Links.** A markdown link to a file — `[text](page.md)`, `[text](docs/page.md#anchor)`,
  `[text](#anchor)` — must name a file that exists, relative to the linking document, and
  an anchor, where it gives one, must be a heading's anchor in that file (a markdown file):
  GitHub's rule, which mkdocs follows for plain headings. Links with a scheme (`https:`)
  are not checked.
- **Commands.** Every `draftgen VERB ...` shown in a code block (a line that starts with
  it) or an inline code span, every span that starts with a verb (`run --metrics-port`,
  `plan --server/--from-run`), and every bare `--option` span in the same paragraph or list
  item after such a mention must name a verb (nested ones too: `engine build-model`) and
  options the real CLI has. A bare option span right after the word vLLM, SGLang or engine
  is an engine's flag and is not checked. The CLI is asked through
  `python -m draftgen VERB --help` with this interpreter; each verb's help is read once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
HELP_TIMEOUT_S = 60.0

_FENCE = re.compile(r"^\s*(```+|~~~+)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# "see X", "(see X and Y)"; X starts with a capital letter and ends at punctuation.
_SEE = re.compile(r"\b[Ss]ee\s+(?P<ref>[A-Z][^.,;:!?()\[\]{}\"\x00\n]*)")
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
_SCHEME = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:|//)")
_OPTION = re.compile(r"^--?[A-Za-z][A-Za-z0-9_-]*$")
_COMMAND_LINE = re.compile(r"^\s*(?:\$\s+)?(?:\S*/)?draftgen\s+(?P<rest>.*)$")
_ENGINE_WORDS = frozenset({"vllm", "sglang", "vllm's", "sglang's", "engine", "engine's"})
# A placeholder for code spans in prose: no reference can start or run through it.
_SPAN_MARK = "\x00"


@dataclass(frozen=True, slots=True)
class Mention:
    """Command words shown in a document.

    `command`: the words after `draftgen`, verb first. `maybe`: a code span that starts with
    a lowercase word, a command if that word is a verb. `option`: a bare `--option` span;
    `before` holds the command words of the spans before it in its paragraph, latest last.
    """

    line: int
    text: str
    tokens: tuple[str, ...]
    kind: Literal["command", "maybe", "option"] = "command"
    before: tuple[tuple[str, ...], ...] = ()


@dataclass(slots=True)
class Document:
    path: Path
    headings: list[tuple[int, str]] = field(default_factory=list)  # (level, text)
    references: list[tuple[int, str]] = field(default_factory=list)  # (line, words)
    # (line, target): every link without a scheme, `#anchor`, `page.md`, `page.md#anchor`
    links: list[tuple[int, str]] = field(default_factory=list)
    mentions: list[Mention] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Help:
    """What one command's --help says: its options and, for a group, its subcommands."""

    options: frozenset[str]
    commands: frozenset[str]


# --- reading the documents -------------------------------------------------------------------


def default_documents(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def shown(path: Path) -> str:
    """A path as a problem line names it: relative to the repository where it is inside."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def read_document(path: Path) -> Document:
    doc = Document(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    fence: str | None = None
    block: list[tuple[int, str]] = []
    for number, line in enumerate(lines, 1):
        fenced = _FENCE.match(line)
        if fence is not None:
            if fenced and fenced.group(1)[0] == fence[0] and len(fenced.group(1)) >= len(fence):
                fence = None
            else:
                _code_line(doc, number, line)
            continue
        if fenced:
            _prose_block(doc, block)
            block = []
            fence = fenced.group(1)
            continue
        heading = _HEADING.match(line)
        if heading:
            _prose_block(doc, block)
            block = []
            doc.headings.append((len(heading.group(1)), heading.group(2)))
            continue
        if not line.strip() or _LIST_ITEM.match(line):
            _prose_block(doc, block)
            block = []
        if line.strip():
            block.append((number, line))
    _prose_block(doc, block)
    return doc


def _code_line(doc: Document, number: int, line: str) -> None:
    m = _COMMAND_LINE.match(line)
    if m is None:
        return
    rest = re.sub(r"\s#.*$", "", m.group("rest"))
    doc.mentions.append(Mention(number, f"draftgen {rest.strip()}", tuple(rest.split())))


def _prose_block(doc: Document, block: Sequence[tuple[int, str]]) -> None:
    """One paragraph or list item: its references, links and command mentions."""
    if not block:
        return
    starts: list[int] = []
    text = ""
    for _, line in block:
        starts.append(len(text))
        text += line.strip() + " "

    def line_at(offset: int) -> int:
        i = max(i for i, s in enumerate(starts) if s <= offset)
        return block[i][0]

    masked = _CODE_SPAN.sub(lambda m: _SPAN_MARK * len(m.group(0)), text)
    for m in _SEE.finditer(masked):
        doc.references.append((line_at(m.start()), m.group("ref").strip()))
    for m in _LINK.finditer(masked):
        if not _SCHEME.match(m.group("target")):
            doc.links.append((line_at(m.start()), m.group("target")))
    before: list[tuple[str, ...]] = []
    for m in _CODE_SPAN.finditer(text):
        span = " ".join(m.group(2).split())
        words = tuple(span.split())
        if not words:
            continue
        number = line_at(m.start())
        if words[0] == "draftgen":
            if len(words) > 1:
                doc.mentions.append(Mention(number, span, words[1:]))
                before.append(_verb_words(words[1:]))
        elif _OPTION.match(words[0].split("/")[0]):
            if before and _previous_word(text, m.start()) not in _ENGINE_WORDS:
                doc.mentions.append(Mention(number, span, words, "option", tuple(before)))
        elif re.fullmatch(r"[a-z][a-z-]*", words[0]):
            # Maybe a verb (`run --metrics-port`); told once the CLI's verbs are known.
            doc.mentions.append(Mention(number, span, words, "maybe"))
            before.append(_verb_words(words))


def _verb_words(tokens: Sequence[str]) -> tuple[str, ...]:
    """The leading words that may name a command path (`engine build-model`)."""
    out = []
    for t in tokens[:2]:
        if not re.fullmatch(r"[a-z][a-z0-9-]*", t):
            break
        out.append(t)
    return tuple(out)


def _previous_word(text: str, offset: int) -> str:
    words = re.findall(r"[\w'’]+", text[:offset])
    return words[-1].lower().replace("’", "'") if words else ""


def option_names(tokens: Iterable[str]) -> Iterator[str]:
    """Option names in command words: `[--server`, `--a/--b`, `--to=FILE`, `-n`."""
    for token in tokens:
        for part in token.strip("[](){},;").split("/"):
            name = part.split("=", 1)[0].rstrip(".,;:")
            if _OPTION.match(name):
                yield name


# --- asking the CLI --------------------------------------------------------------------------


class CliError(Exception):
    pass


def parse_help(text: str) -> Help:
    """Options and subcommands from typer's rich help (panels) or click's plain help."""
    options: set[str] = set()
    commands: set[str] = set()
    section = ""
    for raw in text.splitlines():
        panel = re.match(r"^\s*╭─+\s*(.*?)\s*─", raw)
        if panel:
            section = panel.group(1).lower()
            continue
        plain = re.match(r"^([A-Z][A-Za-z ]*):\s*$", raw)
        if plain:
            section = plain.group(1).lower()
            continue
        line = raw.strip().strip("│").rstrip("│")
        if not line.strip() or raw.lstrip().startswith("╰"):
            continue
        words = line.split()
        if "command" in section:
            # A command row starts at the panel's left edge; descriptions wrap indented.
            indent = len(line) - len(line.lstrip())
            if indent <= 2 and re.fullmatch(r"[a-z][a-z0-9_-]*", words[0]):
                commands.add(words[0])
        elif "argument" not in section:
            for word in words:
                if word in ("*", "/"):
                    continue
                names = [n.rstrip(",") for n in word.split("/") if n]
                if not names or not all(_OPTION.match(n) for n in names):
                    break
                options.update(names)
    return Help(frozenset(options), frozenset(commands))


class Cli:
    """`python -m draftgen ... --help`, once per command path."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self._cache: dict[tuple[str, ...], Help | CliError] = {}
        self.env = {**os.environ, "COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1",
                    "PYTHONPATH": os.pathsep.join(
                        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
        self.env.pop("FORCE_COLOR", None)

    def _run(self, path: tuple[str, ...]) -> Help | CliError:
        argv = [self.python, "-m", "draftgen", *path, "--help"]
        shown = " ".join(["python", *argv[1:]])
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=self.env,
                                  timeout=HELP_TIMEOUT_S, cwd=ROOT, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return CliError(f"`{shown}` could not run: {e}")
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return CliError(f"`{shown}` exited {done.returncode}: {tail[0]}")
        return parse_help(done.stdout)

    def prefetch(self, paths: Iterable[tuple[str, ...]]) -> None:
        todo = sorted({p for p in paths if p not in self._cache})
        with ThreadPoolExecutor(max_workers=8) as pool:
            for path, result in zip(todo, pool.map(self._run, todo), strict=True):
                self._cache[path] = result

    def known(self, path: tuple[str, ...]) -> bool:
        """Whether the command path exists (its help answers)."""
        try:
            self.help(path)
        except CliError:
            return False
        return True

    def help(self, path: tuple[str, ...]) -> Help:
        if path not in self._cache:
            self._cache[path] = self._run(path)
        result = self._cache[path]
        if isinstance(result, CliError):
            raise result
        return result


# --- the checks ------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return [w for w in (re.sub(r"[^\w]", "", w.lower()) for w in text.split()) if w]


SECTION_LEVELS = (1, 2, 3)


def check_references(doc: Document, documents: Iterable[Document] = ()) -> tuple[list[str], int]:
    """Problems with `doc`'s section references, and how many were checked: each must name a
    `#`, `##` or `###` heading of `doc` or of one of `documents`."""
    heading_words = [_words(text) for d in (doc, *documents)
                     for level, text in d.headings if level in SECTION_LEVELS]

    def names_a_section(ref: str) -> bool:
        want = _words(ref)
        return bool(want) and any(h[: len(want)] == want for h in heading_words)

    problems = []
    checked = 0
    for line, ref in doc.references:
        parts = [ref] if names_a_section(ref) else re.split(r"\s+and\s+", ref)
        for part in parts:
            checked += 1
            if not names_a_section(part):
                problems.append(f"{shown(doc.path)}:{line}: 'see {part}' names no section "
                                f"(no #, ## or ### heading starts with {part!r})")
    return problems, checked


def check_links(doc: Document, documents: Iterable[Document] = ()) -> tuple[list[str], int]:
    """Problems with `doc`'s links, and how many were checked: each must name a file that
    exists (relative to `doc`) and, where it gives an anchor, a heading of that file. A file
    among `documents` is not read again."""
    known = {d.path.resolve(): d for d in (doc, *documents)}
    problems = []
    for line, target in doc.links:
        where = f"{shown(doc.path)}:{line}: link to {target}"
        name, _, anchor = target.partition("#")
        path = (doc.path.parent / unquote(name)).resolve() if name else doc.path.resolve()
        if not path.exists():
            problems.append(f"{where}: no file {shown(path)}")
            continue
        if not anchor:
            continue
        if path.suffix.lower() not in (".md", ".markdown"):
            problems.append(f"{where}: an anchor into {shown(path)}, which is not markdown")
            continue
        if path not in known:
            known[path] = read_document(path)
        if anchor not in github_anchors(h for _, h in known[path].headings):
            problems.append(f"{where}: {shown(path)} has no heading with anchor #{anchor}")
    return problems, len(doc.links)


def github_anchors(headings: Iterable[str]) -> set[str]:
    """The anchors GitHub gives headings (lower case, punctuation out, spaces to hyphens)."""
    seen: dict[str, int] = {}
    out = set()
    for h in headings:
        text = re.sub(r"`|\*\*|__", "", h).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def check_commands(doc: Document, cli: Cli) -> tuple[list[str], int]:
    """Problems, and how many verbs and options were checked."""
    try:
        verbs = cli.help(()).commands
    except CliError as e:
        return [f"{shown(doc.path)}: cannot read the CLI's commands: {e}"], 0
    cli.prefetch((v,) for v in verbs)
    groups = [v for v in verbs if cli.known((v,)) and cli.help((v,)).commands]
    cli.prefetch((g, c) for g in groups for c in cli.help((g,)).commands)
    problems: list[str] = []
    checked = 0
    for m in doc.mentions:
        where = f"{shown(doc.path)}:{m.line}: `{m.text}`"
        if m.kind == "option":
            latest = next((b for b in reversed(m.before) if b and b[0] in verbs), None)
            if latest is None:
                continue  # no command before it in its paragraph: an engine's flag, say
            path, _, problem = _command_path(latest, cli)
            if problem:
                continue  # reported where that command is shown
            rest: Sequence[str] = m.tokens
        else:
            if m.tokens[0] not in verbs:
                if m.kind == "maybe":
                    continue  # a code span that does not start with a verb
                checked += 1
                problems.append(f"{where}: no command {m.tokens[0]!r} "
                                f"(the CLI has: {', '.join(sorted(verbs))})")
                continue
            path, rest, problem = _command_path(m.tokens, cli)
            checked += len(path)
            if problem:
                problems.append(f"{where}: {problem}")
                continue
        try:
            known = cli.help(path).options
        except CliError as e:
            problems.append(f"{where}: {e}")
            continue
        for name in option_names(rest):
            checked += 1
            if name not in known:
                problems.append(f"{where}: `draftgen {' '.join(path)}` has no option {name} "
                                f"(it has: {', '.join(sorted(known - {'--help'}))})")
    return problems, checked


def _command_path(tokens: Sequence[str], cli: Cli,
                  ) -> tuple[tuple[str, ...], Sequence[str], str | None]:
    """(command path, the words after it, a problem) for words after `draftgen`."""
    path: tuple[str, ...] = (tokens[0],)
    rest = tokens[1:]
    while True:
        try:
            subcommands = cli.help(path).commands
        except CliError as e:
            return path, rest, str(e)
        if not subcommands or not rest or rest[0].startswith("-"):
            return path, rest, None
        if rest[0] not in subcommands:
            return path, rest, (f"`draftgen {' '.join(path)}` has no command {rest[0]!r} "
                                f"(it has: {', '.join(sorted(subcommands))})")
        path, rest = (*path, rest[0]), rest[1:]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a.startswith("-") for a in args):
        print("usage: check_docs.py [FILE.md|DIR ...]", file=sys.stderr)
        return 2
    paths: list[Path] = []
    for arg in args:
        path = Path(arg)
        paths.extend(sorted(path.rglob("*.md")) if path.is_dir() else [path])
    docs = []
    for path in paths or default_documents():
        try:
            docs.append(read_document(path))
        except OSError as e:
            print(f"docs: cannot read {path}: {e.strerror}", file=sys.stderr)
            return 2
    cli = Cli()
    problems: list[str] = []
    refs = links = cmds = 0
    for doc in docs:
        others = [d for d in docs if d is not doc]
        found, n = check_references(doc, others)
        problems += found
        refs += n
        found, n = check_links(doc, others)
        problems += found
        links += n
        found, n = check_commands(doc, cli)
        problems += found
        cmds += n
    for p in problems:
        print(p)
    names = ", ".join(shown(d.path) for d in docs) if len(docs) <= 3 else f"{len(docs)} files"
    if problems:
        print(f"docs: {names}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"docs: {names} ok ({refs} sections referenced, {links} links followed, "
          f"{cmds} commands/options checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
