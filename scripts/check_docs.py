"""Check that the README's cross-references and command lines match the document and the CLI.

    python scripts/check_docs.py [README.md]

Two checks, one line per problem, exit 1 if there is any:

- **Sections.** A reference in prose — `see Scheduling`, `(see Resume)`, `see Servers and
  Data quality` — must name a `##` or `###` heading: the heading must start with the
  referenced words (case-insensitive, punctuation ignored), so `see Servers` matches
  `## Servers: profiles, launch and the quality policy`. A reference is the text after
  "see" from its first capitalised word up to the next punctuation mark; "and" joins
  several. A markdown link `[text](#anchor)` must name a heading's GitHub anchor.
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

ROOT = Path(__file__).resolve().parents[1]
HELP_TIMEOUT_S = 60.0

_FENCE = re.compile(r"^\s*(```+|~~~+)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# "see X", "(see X and Y)"; X starts with a capital letter and ends at punctuation.
_SEE = re.compile(r"\b[Ss]ee\s+(?P<ref>[A-Z][^.,;:!?()\[\]{}\"\x00\n]*)")
_ANCHOR_LINK = re.compile(r"\]\(#(?P<anchor>[^)\s]*)\)")
_OPTION = re.compile(r"^--?[A-Za-z][A-Za-z0-9_-]*$")
_COMMAND_LINE = re.compile(r"^\s*(?:\$\s+)?(?:\S*/)?draftgen\s+(?P<rest>.*)$")
_ENGINE_WORDS = frozenset({"vllm", "sglang", "vllm's", "sglang's", "engine", "engine's"})
# A placeholder for code spans in prose: no reference can start or run through it.
_SPAN_MARK = "\x00"


@dataclass(frozen=True, slots=True)
class Mention:
    """Command words shown in the README.

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
    anchors: list[tuple[int, str]] = field(default_factory=list)  # (line, anchor)
    mentions: list[Mention] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Help:
    """What one command's --help says: its options and, for a group, its subcommands."""

    options: frozenset[str]
    commands: frozenset[str]


# --- reading the README ----------------------------------------------------------------------


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
    """One paragraph or list item: its references, anchors and command mentions."""
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
    for m in _ANCHOR_LINK.finditer(masked):
        doc.anchors.append((line_at(m.start()), m.group("anchor")))
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


def check_references(doc: Document) -> tuple[list[str], int]:
    """Problems, and how many references were checked."""
    sections = [text for level, text in doc.headings if level in (2, 3)]
    heading_words = [_words(h) for h in sections]

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
                problems.append(f"{doc.path}:{line}: 'see {part}' names no section "
                                f"(no ## or ### heading starts with {part!r})")
    slugs = github_anchors(h for _, h in doc.headings)
    for line, anchor in doc.anchors:
        checked += 1
        if anchor not in slugs:
            problems.append(f"{doc.path}:{line}: link to #{anchor} names no heading")
    return problems, checked


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
        return [f"{doc.path}: cannot read the CLI's commands: {e}"], 0
    cli.prefetch((v,) for v in verbs)
    groups = [v for v in verbs if cli.known((v,)) and cli.help((v,)).commands]
    cli.prefetch((g, c) for g in groups for c in cli.help((g,)).commands)
    problems: list[str] = []
    checked = 0
    for m in doc.mentions:
        where = f"{doc.path}:{m.line}: `{m.text}`"
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
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print("usage: check_docs.py [README.md]", file=sys.stderr)
        return 2
    path = Path(args[0]) if args else ROOT / "README.md"
    try:
        doc = read_document(path)
    except OSError as e:
        print(f"docs: cannot read {path}: {e.strerror}", file=sys.stderr)
        return 2
    ref_problems, refs = check_references(doc)
    cmd_problems, cmds = check_commands(doc, Cli())
    problems = ref_problems + cmd_problems
    for p in problems:
        print(p)
    name = "README" if path.resolve() == ROOT / "README.md" else str(path)
    if problems:
        print(f"docs: {name}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"docs: {name} ok ({refs} sections referenced, {cmds} commands/options checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
