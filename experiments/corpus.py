"""python experiments/corpus.py --out data/corpus

Assemble a multi-domain text corpus for training a small Mixture-of-Experts
language model whose experts should specialise by *kind* of text.

Every byte comes from files that Debian packages (plus the nodesource
``nodejs`` package for JavaScript) install on this machine; nothing is
downloaded.  Domains (see ``DOMAINS`` below, or run with ``--list``):

    python      Python standard library sources      libpython3.11-minimal, libpython3.11-stdlib
    c           C headers (glibc + Linux UAPI)       libc6-dev, linux-libc-dev
    javascript  npm's sources and bundled deps        nodejs (nodesource build, ships npm)
    shell       bash completions + sh/bash scripts    bash-completion, + owners of /usr/bin scripts
    licenses    licence texts and copyright files     base-files, + every installed package
    manpages    rendered English man pages            manpages, manpages-dev, man-db, groff-base
    english     fortune cookies                       fortunes, fortunes-min
    german      fortune cookies                       fortunes-de
    spanish     fortune cookies (not the off/ set)    fortunes-es
    italian     fortune cookies                       fortunes-it
    french      French prose from Debian manuals      debian-reference-fr, debian-faq-fr,
                                                      maint-guide-fr, developers-reference-fr

Install everything with

    apt-get install fortunes fortunes-min fortunes-de fortunes-es fortunes-it \\
        debian-reference-fr debian-faq-fr maint-guide-fr developers-reference-fr \\
        bash-completion manpages manpages-dev man-db groff-base libc6-dev linux-libc-dev

Output, for each domain ``D``::

    <out>/D/train.txt     documents separated by one blank line
    <out>/D/heldout.txt   same format; disjoint from train by source file
                          (code, man pages, licences) or by record (fortunes,
                          French paragraphs-groups)
    <out>/manifest.json   per domain: sources, packages (with versions), file
                          and document counts, bytes and sha256 of both files

Documents may themselves contain single blank lines (code, man pages), so the
document boundaries are not recoverable from the text files; the split is made
before writing, so held-out text never shares a source file with train text.

Processing, per domain: list the input files (sorted; for package-owned sources
exactly the files ``dpkg`` lists for those packages), read them as strict UTF-8
(files with NUL bytes or invalid UTF-8 are dropped), extract documents (whole
files truncated to ``--max-file-bytes``, single fortunes, rendered man pages, or
groups of French paragraphs), normalise (NFC, LF newlines, no control
characters or overstrikes, no trailing spaces, at most one blank line in a row),
drop exact duplicates, then sample with ``--seed`` up to ``--max-bytes`` per
domain and move ~``--heldout-fraction`` of the bytes (whole groups, chosen by a
seeded hash) into the held-out file.  Everything is deterministic: same
installed packages + same arguments => byte-identical output.

Uses only the standard library and tqdm.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

PY = "3.11"  # Debian bookworm's python3
DPKG_INFO = Path("/var/lib/dpkg/info")
COMMAND = "python experiments/corpus.py --out data/corpus"


# --------------------------------------------------------------------------- domains


@dataclass(frozen=True)
class Source:
    """Files under ``root`` whose path relative to ``root`` matches ``include``.

    ``packages`` are the Debian packages that ship them.  With ``owned=True``
    only files that ``dpkg`` lists for those packages are used (so the input set
    is exactly "what these packages install"); with ``owned=False`` every
    matching file under ``root`` is used (e.g. all /usr/share/doc/*/copyright).
    Patterns: ``*`` and ``?`` do not cross ``/``; ``**/`` matches any number of
    directories.  ``shebang``: a regex the first line must match, if given.
    """

    root: str
    include: tuple[str, ...]
    packages: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    owned: bool = True
    shebang: str | None = None


@dataclass(frozen=True)
class Domain:
    name: str
    description: str
    kind: str  # "file" | "code" | "man" | "fortune" | "prose-fr"
    sources: tuple[Source, ...]
    tools: tuple[tuple[str, str], ...] = ()  # (executable, Debian package)
    notes: str = ""


FORTUNE_JUNK = ("**/*.dat", "**/*.u8")
CHARSET_PAGES = tuple(
    f"man7/{p}*" for p in ("ascii", "armscii-8", "cp125", "iso_8859", "koi8", "latin")
)
SH_SHEBANG = r"#! ?(/usr)?/bin/(env +)?(ba|da)?sh\b"

DOMAINS: tuple[Domain, ...] = (
    Domain(
        "python",
        "Python standard library sources (no test suites, codec tables or pydoc topics)",
        "code",
        (
            Source(
                f"/usr/lib/python{PY}",
                ("**/*.py",),
                (f"libpython{PY}-minimal", f"libpython{PY}-stdlib"),
                exclude=(
                    "test/**/*",
                    "**/tests/**/*",
                    "idlelib/idle_test/**/*",
                    "lib2to3/tests/**/*",
                    "encodings/*",
                    "pydoc_data/*",
                    "config-*/**/*",
                    "site-packages/**/*",
                    "dist-packages/**/*",
                ),
            ),
        ),
    ),
    Domain(
        "c",
        "C headers of the GNU C library and the Linux kernel UAPI",
        "code",
        (Source("/usr/include", ("**/*.h",), ("libc6-dev", "linux-libc-dev")),),
    ),
    Domain(
        "javascript",
        "JavaScript sources of npm and its bundled dependencies (minified files dropped)",
        "code",
        (
            Source(
                "/usr/lib/node_modules",
                ("**/*.js", "**/*.cjs", "**/*.mjs"),
                ("nodejs",),
                exclude=("**/*.min.js", "**/iconv-lite/encodings/**/*"),
            ),
        ),
        notes="nodejs here is the nodesource build, which bundles npm under "
        "/usr/lib/node_modules/npm; Debian's own nodejs does not.",
    ),
    Domain(
        "shell",
        "bash completion scripts and package-owned sh/bash scripts in /usr/bin, /usr/sbin",
        "code",
        (
            Source(
                "/usr/share/bash-completion",
                ("bash_completion", "completions/*"),
                ("bash-completion",),
            ),
            Source("/usr/bin", ("*",), (), owned=False, shebang=SH_SHEBANG),
            Source("/usr/sbin", ("*",), (), owned=False, shebang=SH_SHEBANG),
        ),
        notes="Scripts in /usr/bin and /usr/sbin are kept only if a Debian package owns "
        "them (see owning_packages in the manifest).",
    ),
    Domain(
        "licenses",
        "software licence texts and Debian copyright files",
        "file",
        (
            Source("/usr/share/common-licenses", ("*",), ("base-files",)),
            Source("/usr/share/doc", ("*/copyright",), (), owned=False),
        ),
        notes="/usr/share/doc/*/copyright comes from every installed package; exact "
        "duplicates are dropped.",
    ),
    Domain(
        "manpages",
        "English man pages of the Linux man-pages project, rendered to plain text (80 cols)",
        "man",
        (
            Source(
                "/usr/share/man",
                ("man*/*",),
                ("manpages", "manpages-dev"),
                # character-set tables: mostly box drawing and exotic glyphs
                exclude=CHARSET_PAGES,
            ),
        ),
        tools=(("man", "man-db"), ("groff", "groff-base")),
    ),
    Domain(
        "english",
        "English fortune cookies (quotes, jokes, poems)",
        "fortune",
        (
            Source(
                "/usr/share/games/fortunes",
                ("*",),
                ("fortunes", "fortunes-min"),
                exclude=FORTUNE_JUNK + ("ascii-art",),
            ),
        ),
    ),
    Domain(
        "german",
        "German fortune cookies (quotes, jokes, recipes, proverbs)",
        "fortune",
        (
            Source(
                "/usr/share/games/fortunes/de",
                ("*",),
                ("fortunes-de",),
                exclude=FORTUNE_JUNK + ("asciiart", "translations", "channel-debian.fortunes"),
            ),
        ),
    ),
    Domain(
        "spanish",
        "Spanish fortune cookies (proverbs, quotes); the offensive off/ set is excluded",
        "fortune",
        (
            Source(
                "/usr/share/games/fortunes/es",
                ("*",),
                ("fortunes-es",),
                exclude=FORTUNE_JUNK + ("off/**/*",),
            ),
        ),
    ),
    Domain(
        "italian",
        "Italian fortune cookies",
        "fortune",
        (
            Source(
                "/usr/share/games/fortunes/it",
                ("*",),
                ("fortunes-it",),
                exclude=FORTUNE_JUNK + ("banner",),
            ),
        ),
    ),
    Domain(
        "french",
        "French prose paragraphs from the French Debian manuals (untranslated English "
        "paragraphs, tables and code blocks filtered out)",
        "prose-fr",
        (
            Source("/usr/share/debian-reference", ("*.fr.txt.gz",), ("debian-reference-fr",)),
            Source("/usr/share/doc/debian/FAQ", ("*.fr.txt.gz",), ("debian-faq-fr",)),
            Source("/usr/share/doc/maint-guide-fr", ("*.fr.txt.gz",), ("maint-guide-fr",)),
            Source(
                "/usr/share/developers-reference/fr",
                ("*.txt.gz",),
                ("developers-reference-fr",),
            ),
        ),
        notes="Debian bookworm has no fortunes-fr package, hence manuals.",
    ),
)
DOMAIN_BY_NAME = {d.name: d for d in DOMAINS}
RECORD_KINDS = {"fortune", "prose-fr"}  # many small documents per file


def required_packages(domain: Domain) -> list[str]:
    pkgs = [p for s in domain.sources for p in s.packages] + [p for _, p in domain.tools]
    return sorted(set(pkgs))


# --------------------------------------------------------------------------- dpkg


def _dpkg_list_file(pkg: str) -> Path | None:
    for cand in [DPKG_INFO / f"{pkg}.list", *sorted(DPKG_INFO.glob(f"{pkg}:*.list"))]:
        if cand.is_file():
            return cand
    return None


def _canon(path: str) -> str:
    """Map pre-usrmerge paths (/bin/x, /lib/x) to /usr/... where /bin etc. are symlinks."""
    for top in ("/bin/", "/sbin/", "/lib/", "/lib32/", "/lib64/", "/libx32/"):
        if path.startswith(top) and os.path.islink(top[:-1]):
            return "/usr" + path
    return path


def dpkg_files(pkg: str) -> list[str]:
    lst = _dpkg_list_file(pkg)
    if lst is None:
        return []
    return [_canon(line) for line in lst.read_text("utf-8", "replace").splitlines() if line]


_OWNERS: dict[str, str] | None = None


def owner_of(path: str) -> str | None:
    """Debian package that installed ``path`` (first by name if several), or None."""
    global _OWNERS
    if _OWNERS is None:
        _OWNERS = {}
        for lst in sorted(DPKG_INFO.glob("*.list")):
            pkg = lst.name[: -len(".list")].split(":")[0]
            for line in lst.read_text("utf-8", "replace").splitlines():
                if line:
                    _OWNERS.setdefault(_canon(line), pkg)
    return _OWNERS.get(path)


def package_versions(pkgs: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = dict.fromkeys(pkgs)
    if not pkgs or shutil.which("dpkg-query") is None:
        return out
    res = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package}\t${Version}\t${db:Status-Abbrev}\n", *pkgs],
        capture_output=True,
        text=True,
    )
    for line in res.stdout.splitlines():
        name, version, status = (line.split("\t") + ["", ""])[:3]
        if name in out and status.startswith("ii"):
            out[name] = version
    return out


# --------------------------------------------------------------------------- listing


def _glob_re(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def list_source(src: Source) -> list[str]:
    root = src.root.rstrip("/")
    if src.owned:
        cands = {p for pkg in src.packages for p in dpkg_files(pkg) if p.startswith(root + "/")}
    else:
        cands = {str(p) for p in Path(root).rglob("*")}
    inc = [_glob_re(p) for p in src.include]
    exc = [_glob_re(p) for p in src.exclude]
    out = []
    for path in cands:
        rel = path[len(root) + 1 :]
        if not any(r.match(rel) for r in inc) or any(r.match(rel) for r in exc):
            continue
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        if not src.owned and owner_of(path) is None:
            continue  # provenance must be a Debian package
        out.append(path)
    return sorted(out)


def check_inputs(domain: Domain) -> list[str]:
    """Human-readable problems (missing packages, directories, tools); empty if OK."""
    problems = []
    for src in domain.sources:
        missing = [p for p in src.packages if _dpkg_list_file(p) is None]
        if missing or not os.path.isdir(src.root):
            pkgs = " ".join(missing or src.packages) or "(the packages that own it)"
            problems.append(
                f"[{domain.name}] input {src.root} needs Debian package(s) {pkgs}: "
                f"install with `apt-get install {pkgs}`"
            )
    for exe, pkg in domain.tools:
        if shutil.which(exe) is None:
            problems.append(
                f"[{domain.name}] needs the `{exe}` command from Debian package {pkg}: "
                f"install with `apt-get install {pkg}`"
            )
    return problems


# --------------------------------------------------------------------------- text


_OVERSTRIKE = re.compile(r"[^\n]\x08")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_BLANKS = re.compile(r"\n{3,}")


_NBSP = re.compile("[\u00a0\u2007\u202f]")
_MOJIBAKE = re.compile("[\u00c2-\u00f4][\u0080-\u00bf]{1,3}")


def _unmojibake(m: re.Match[str]) -> str:
    try:
        return m.group().encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:
        return m.group()


def normalise(text: str, prose: bool = False) -> str:
    """Canonical form of a document.

    ``prose``: also turn no-break spaces into spaces and repair UTF-8 that was
    decoded as Latin-1 once too often ("FranÃ§ois" -> "François"); not done
    for code, where such characters can be meaningful string contents.
    """
    text = unicodedata.normalize("NFC", text).lstrip("\ufeff")
    if prose:
        text = unicodedata.normalize("NFC", _MOJIBAKE.sub(_unmojibake, text))
        text = _NBSP.sub(" ", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n")
    while "\x08" in text:
        new = _OVERSTRIKE.sub("", text)
        if new == text:
            break
        text = new
    text = _CONTROL.sub("", _ANSI.sub("", text))
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip("\n")


def truncate(text: str, max_bytes: int) -> str:
    """Cut to at most ``max_bytes`` UTF-8 bytes, preferably at a blank line."""
    data = text.encode()
    if len(data) <= max_bytes:
        return text
    cut = data[:max_bytes].decode("utf-8", "ignore")
    i = cut.rfind("\n\n")
    if i < len(cut) // 2:
        i = cut.rfind("\n")
    return cut[: max(i, 0)].rstrip("\n")


def read_utf8(path: str, stats: Counter) -> str | None:
    raw = Path(path).read_bytes()
    if path.endswith(".gz"):
        raw = gzip.decompress(raw)
    if b"\x00" in raw:
        stats["dropped_binary"] += 1
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats["dropped_undecodable"] += 1
        return None


def letter_ratio(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in chars) / max(len(chars), 1)


_FR = set(
    "le la les des du de un une et est pour dans que qui sur par avec pas ne au aux ce cette "
    "il elle vous nous sont être plus ou en se sa son ses on si à peut être ces leur été "
    "également lorsque sous votre vos fichier paquet paquets ceci cela d l qu n c j".split()
)
_EN = set(
    "the and is of to in for with this that you are be it on as by or not can from "
    "which your will have an if use when".split()
)
_UNDERLINE = re.compile(r"^[ \t]*([=~^-])\1{2,}[ \t]*$", re.M)
_WORD = re.compile(r"[a-zàâäçéèêëîïôöûùüÿœæ]+")


def is_french(par: str) -> bool:
    words = _WORD.findall(par.lower())
    fr = sum(w in _FR for w in words)
    en = sum(w in _EN for w in words)
    tabular = any(line.lstrip().startswith(("|", "+-", "$ ", "# ")) for line in par.split("\n"))
    if tabular or letter_ratio(par) < 0.75:
        return False
    if len(par) < 100 and en == 0 and fr >= 1:
        return True  # headings, short list items
    return fr >= 3 and fr >= 3 * en


def render_man(path: str) -> str | None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "MANWIDTH": "80",
        "HOME": os.environ.get("HOME", "/root"),
    }
    res = subprocess.run(
        ["man", "-l", "--nh", "--nj", "-P", "cat", path],
        capture_output=True,
        env=env,
        timeout=120,
    )
    if res.returncode != 0 or not res.stdout.strip():
        return None
    try:
        return res.stdout.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass
class Doc:
    text: str
    group: str  # held-out split unit: the source file, or the record text
    path: str
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = len(self.text.encode())


def extract(domain: Domain, path: str, src: Source, args, stats: Counter) -> list[Doc]:
    """Documents of one input file (empty list if the file is dropped)."""
    kind = domain.kind
    if kind == "man":
        head = gzip.decompress(Path(path).read_bytes()) if path.endswith(".gz") else b""
        if head.lstrip().startswith(b".so "):
            stats["dropped_alias"] += 1  # ".so other.3": an alias page
            return []
        text = render_man(path)
        if text is None:
            stats["dropped_render_failed"] += 1
            return []
    else:
        if src.shebang is not None:
            with open(path, "rb") as f:
                first = f.read(256).split(b"\n", 1)[0].decode("latin-1")
            if not re.match(src.shebang, first):
                stats["dropped_no_shebang"] += 1
                return []
        text = read_utf8(path, stats)
        if text is None:
            return []
    text = normalise(text, prose=kind in RECORD_KINDS)

    if kind in ("file", "code", "man"):
        if kind == "code":
            lines = text.split("\n")
            longest = max(map(len, lines))
            if longest > 1000 or len(text) / max(len(lines), 1) > 150:
                stats["dropped_minified"] += 1
                return []
            if sum(ord(c) > 127 for c in text) > 0.02 * len(text):
                stats["dropped_data_table"] += 1  # e.g. character-set tables
                return []
        text = truncate(text, args.max_file_bytes)
        if len(text) < args.min_doc_chars:
            stats["dropped_too_short"] += 1
            return []
        return [Doc(text, path, path)]

    if kind == "fortune":
        docs = []
        for rec in re.split(r"^%+[ \t]*$", text, flags=re.M):
            rec = rec.strip("\n")
            if len(rec.strip()) < args.min_doc_chars:
                continue
            if letter_ratio(rec) < 0.5:
                stats["records_dropped_ascii_art"] += 1
                continue
            docs.append(Doc(rec, rec, path))
        return docs

    if kind == "prose-fr":
        docs, cur = [], []
        text = _UNDERLINE.sub("", text)  # setext heading underlines: ===== / -----
        pars = [textwrap.dedent(p).strip("\n") for p in text.split("\n\n")]
        for par in pars + [""]:
            if par and is_french(par):
                cur.append(par)
                if sum(len(p) + 2 for p in cur) < args.prose_doc_chars:
                    continue
            else:
                stats["paragraphs_dropped_not_french"] += bool(par)
            if cur:
                body = "\n\n".join(cur)
                docs.append(Doc(body, body, path))
                cur = []
        return docs

    raise ValueError(f"unknown kind {kind!r}")


# --------------------------------------------------------------------------- build


def _h(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def build_domain(domain: Domain, args) -> dict:
    stats: Counter = Counter()
    files: list[tuple[str, Source]] = []
    for src in domain.sources:
        files += [(p, src) for p in list_source(src)]
    stats["files_listed"] = len(files)
    rng = random.Random(f"{args.seed}:{domain.name}")
    cap = args.max_bytes
    chosen: list[Doc] = []
    seen: set[str] = set()
    total = 0

    def take(doc: Doc) -> bool:
        nonlocal total
        key = hashlib.sha256(doc.text.encode()).digest()
        if key in seen:
            stats["duplicates_dropped"] += 1
            return True
        seen.add(key)
        if total + doc.nbytes + 2 > cap:
            return False
        chosen.append(doc)
        total += doc.nbytes + 2
        return True

    if domain.kind in RECORD_KINDS:
        # Cheap to extract: read everything, then sample documents.
        pool: list[Doc] = []
        for path, src in tqdm(files, desc=f"{domain.name:>10} read", unit="file", leave=False):
            pool += extract(domain, path, src, args, stats)
        stats["docs_available"] = len(pool)
        rng.shuffle(pool)
        for doc in pool:
            take(doc)
    else:
        # One document per file, possibly expensive (man): visit files in seeded
        # random order and stop once the byte budget is used up.
        order = list(files)
        rng.shuffle(order)
        misses = 0
        bar = tqdm(total=cap, desc=f"{domain.name:>10}", unit="B", unit_scale=True, leave=False)
        for path, src in order:
            stats["files_read"] += 1
            for doc in extract(domain, path, src, args, stats):
                before = total
                if take(doc):
                    bar.update(total - before)
                else:
                    misses += 1
            if cap - total < args.min_doc_chars + 2 or misses > 50:
                break
        bar.close()

    # Held-out split by group: order groups by a seeded hash and move whole
    # groups to held-out until it holds ~heldout_fraction of the bytes.
    group_bytes: Counter = Counter()
    for doc in chosen:
        group_bytes[doc.group] += doc.nbytes + 2
    held_groups: set[str] = set()
    held = 0
    target = args.heldout_fraction * total
    for g in sorted(group_bytes, key=lambda g: _h(str(args.seed), domain.name, g)):
        if held >= target:
            break
        held_groups.add(g)
        held += group_bytes[g]
    splits = {
        "train": [d for d in chosen if d.group not in held_groups],
        "heldout": [d for d in chosen if d.group in held_groups],
    }

    outdir = Path(args.out) / domain.name
    outdir.mkdir(parents=True, exist_ok=True)
    entry: dict = {
        "description": domain.description,
        "kind": domain.kind,
        "sources": [
            {
                "root": s.root,
                "include": list(s.include),
                "exclude": list(s.exclude),
                "packages": list(s.packages),
                "only_files_owned_by_packages": s.owned,
                **({"shebang": s.shebang} if s.shebang else {}),
            }
            for s in domain.sources
        ],
        "debian_packages": package_versions(required_packages(domain)),
    }
    if domain.notes:
        entry["notes"] = domain.notes
    used_files = sorted({d.path for d in chosen})
    owners = Counter(owner_of(p) or "?" for p in used_files)
    entry["files_listed"] = stats.pop("files_listed")
    entry["files_used"] = len(used_files)
    entry["owning_packages"] = dict(sorted(owners.items()))
    entry["settings"] = {
        "seed": args.seed,
        "max_bytes": cap,
        "heldout_fraction": args.heldout_fraction,
        "max_file_bytes": args.max_file_bytes,
        "min_doc_chars": args.min_doc_chars,
        **({"prose_doc_chars": args.prose_doc_chars} if domain.kind == "prose-fr" else {}),
    }
    entry["stats"] = dict(sorted(stats.items()))
    for split, docs in splits.items():
        data = ("\n\n".join(d.text for d in docs) + "\n").encode() if docs else b""
        (outdir / f"{split}.txt").write_bytes(data)
        entry[split] = {
            "file": f"{domain.name}/{split}.txt",
            "documents": len(docs),
            "bytes": len(data),
            "chars": len(data.decode()),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    return entry


# --------------------------------------------------------------------------- main


def print_inputs(domains: list[Domain]) -> None:
    for d in domains:
        print(f"{d.name} ({d.kind}): {d.description}")
        for s in d.sources:
            pk = ", ".join(s.packages) or "any Debian package"
            inc = " ".join(s.include)
            exc = f"  minus {' '.join(s.exclude)}" if s.exclude else ""
            print(f"    {s.root}/{{{inc}}}{exc}   [{pk}]")
        for exe, pkg in d.tools:
            print(f"    needs `{exe}`   [{pkg}]")
    pkgs = sorted({p for d in domains for p in required_packages(d)})
    print("\napt-get install " + " ".join(pkgs))


def summary_table(manifest: dict) -> str:
    cols = ["domain", "files", "docs train", "docs held", "train MB", "held KB", "held %"]
    rows = []
    for name, e in manifest["domains"].items():
        tr, he = e["train"], e["heldout"]
        tot = tr["bytes"] + he["bytes"]
        rows.append(
            [
                name,
                f"{e['files_used']}/{e['files_listed']}",
                str(tr["documents"]),
                str(he["documents"]),
                f"{tr['bytes'] / 1e6:.2f}",
                f"{he['bytes'] / 1e3:.1f}",
                f"{100 * he['bytes'] / max(tot, 1):.1f}",
            ]
        )
    tot_tr = sum(e["train"]["bytes"] for e in manifest["domains"].values())
    tot_he = sum(e["heldout"]["bytes"] for e in manifest["domains"].values())
    rows.append(
        [
            "TOTAL",
            str(sum(e["files_used"] for e in manifest["domains"].values())),
            str(sum(e["train"]["documents"] for e in manifest["domains"].values())),
            str(sum(e["heldout"]["documents"] for e in manifest["domains"].values())),
            f"{tot_tr / 1e6:.2f}",
            f"{tot_he / 1e3:.1f}",
            f"{100 * tot_he / max(tot_tr + tot_he, 1):.1f}",
        ]
    )
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def fmt(r: list[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(r, widths, strict=True))
        )

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(cols), sep, *map(fmt, rows[:-1]), sep, fmt(rows[-1])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="data/corpus", help="output directory")
    ap.add_argument(
        "--domains",
        default=",".join(DOMAIN_BY_NAME),
        help="comma-separated subset of: " + ", ".join(DOMAIN_BY_NAME),
    )
    ap.add_argument(
        "--max-bytes",
        type=int,
        default=2_000_000,
        help="cap per domain, UTF-8 bytes of train+heldout (default 2,000,000)",
    )
    ap.add_argument("--heldout-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-file-bytes",
        type=int,
        default=65_536,
        help="truncate each code/licence/man document to this many bytes",
    )
    ap.add_argument("--min-doc-chars", type=int, default=20, help="drop shorter documents")
    ap.add_argument(
        "--prose-doc-chars",
        type=int,
        default=3000,
        help="group French paragraphs into documents of about this size",
    )
    ap.add_argument(
        "--skip-missing",
        action="store_true",
        help="skip domains whose inputs are missing instead of failing",
    )
    ap.add_argument("--list", action="store_true", help="print inputs and packages, then exit")
    args = ap.parse_args(argv)

    names = [n.strip() for n in args.domains.split(",") if n.strip()]
    unknown = [n for n in names if n not in DOMAIN_BY_NAME]
    if unknown:
        ap.error(f"unknown domain(s) {unknown}; choose from {list(DOMAIN_BY_NAME)}")
    domains = [DOMAIN_BY_NAME[n] for n in DOMAIN_BY_NAME if n in names]
    if args.list:
        print_inputs(domains)
        return 0

    problems = {d.name: check_inputs(d) for d in domains}
    bad = [n for n, p in problems.items() if p]
    if bad:
        print("error: missing inputs:", file=sys.stderr)
        for n in bad:
            for line in problems[n]:
                print("  " + line, file=sys.stderr)
        pkgs = sorted({p for d in domains if d.name in bad for p in required_packages(d)})
        print(f"  fix all with: apt-get install {' '.join(pkgs)}", file=sys.stderr)
        if not args.skip_missing:
            return 2
        print(f"  --skip-missing: skipping {', '.join(bad)}", file=sys.stderr)
        domains = [d for d in domains if d.name not in bad]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest: dict = {"domains": {}}
    if manifest_path.exists() and set(names) != set(DOMAIN_BY_NAME):
        manifest = json.loads(manifest_path.read_text())  # partial rebuild: keep the rest
    new = {}
    for d in tqdm(domains, desc="domains", unit="domain"):
        new[d.name] = build_domain(d, args)
    merged = {**manifest.get("domains", {}), **new}
    manifest = {
        "generator": "experiments/corpus.py",
        "command": COMMAND,
        "format": "UTF-8 text, LF newlines; documents separated by one blank line; "
        "documents contain at most one blank line in a row",
        "domains": {n: merged[n] for n in DOMAIN_BY_NAME if n in merged},
    }
    manifest_path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    print(summary_table(manifest))
    print(f"\nwrote {out}/<domain>/{{train,heldout}}.txt and {manifest_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
