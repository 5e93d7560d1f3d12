"""report.html: a run's report as one self-contained page (no server, no network: the plots
are inlined as data URIs, the text escaped), with sampled dialogues per arm beside the
tables, so that a reader can *see* what a collapsed policy says next to a fixed one.

Both kinds of run write it from their report.md: the toy (`report.write_report`) and the
real runs (`real_report.write_real_report`, also at the end of `train.py`). The page is the
markdown's headings, paragraphs, tables, code blocks and images, then a "Dialogues"
section: `dialogues` is a list of (heading, [(caption, text), ...]).
"""

from __future__ import annotations

import base64
import html
import os
import re
from pathlib import Path

STYLE = """body{font-family:system-ui,sans-serif;max-width:70rem;margin:2rem auto;padding:0 1rem;line-height:1.45}
table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ccc;padding:.2rem .5rem;text-align:left}
pre{background:#f6f6f6;padding:.6rem;overflow-x:auto;white-space:pre-wrap}img{max-width:100%}
.pair{display:grid;grid-template-columns:repeat(auto-fit,minmax(22rem,1fr));gap:1rem}
.caption{font-weight:600;margin:.4rem 0 .1rem}"""


def valid_text(text: str) -> str:
    """`text` as valid Unicode: a lone UTF-16 surrogate (a logged "\\ud800", a served model's
    reply) becomes U+FFFD; a surrogate pair becomes the character it stands for."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def write_report_file(path, text: str) -> Path:
    """Write a report file (report.md, report.html, results.json, ...) as UTF-8, whatever str
    it is given, and atomically: a failure leaves the previous file whole, never a partial one."""
    path = Path(path)
    data = valid_text(text).encode("utf-8")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _inline(text: str) -> str:
    """Escape a line, then the little inline markdown the reports use: `code`, **bold**."""
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)


def code_fence(body: str) -> str:
    """A markdown code fence that `body` cannot close: one backtick longer than its longest
    run of backticks (at least three)."""
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    return "`" * max(3, longest + 1)


def _image(alt: str, name: str, folder: Path) -> str:
    """An image of the run folder, inlined; a path that leads out of it (absolute, `..`, a
    link) is not read: report text can be written by a model or a transcript."""
    root = folder.resolve()
    path = (folder / name).resolve()
    if Path(name).is_absolute() or not path.is_relative_to(root) or not path.is_file() \
            or path.suffix.lower() != ".png":
        return f"<p>[{html.escape(alt)}: {html.escape(name)} not found in the run folder]</p>"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def markdown_html(md: str, folder: Path) -> str:
    """The subset of markdown report.md uses, as HTML; images are read from `folder`."""
    out, lines, i = [], md.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):                       # a code block, to its closing fence
            fence, body = line[: len(line) - len(line.lstrip("`"))], []
            i += 1
            while i < len(lines) and not lines[i].startswith(fence):
                body.append(lines[i])
                i += 1
            out.append("<pre>" + html.escape("\n".join(body)) + "</pre>")
        elif line.startswith("|"):                       # a table: header, |---|, rows
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            i -= 1
            body = [r for r in rows[1:] if not re.fullmatch(r"\|[\s:|-]*", r.strip())]
            out.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in _cells(rows[0])) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in _cells(r)) + "</tr>"
                                 for r in body) + "</table>")
        elif m := re.fullmatch(r"(#{1,4}) (.*)", line):
            n = len(m.group(1))
            out.append(f"<h{n}>{_inline(m.group(2))}</h{n}>")
        elif m := re.fullmatch(r"!\[([^\]]*)\]\(([^)]+)\)", line.strip()):
            out.append(_image(m.group(1), m.group(2), folder))
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
        i += 1
    return "\n".join(out)


def dialogues_html(dialogues) -> str:
    """Each heading with its dialogues side by side (a caption above each)."""
    if not dialogues:
        return ""
    out = ["<h2>Dialogues</h2>"]
    for heading, items in dialogues:
        out.append(f"<h3>{_inline(heading)}</h3><div class=pair>")
        out += [f"<div><div class=caption>{_inline(caption)}</div><pre>{html.escape(text)}</pre></div>"
                for caption, text in items]
        out.append("</div>")
    return "\n".join(out)


def write_html(run_dir, title: str, md: str, dialogues=()) -> Path:
    """Write run_dir/report.html from the report's markdown and the sampled dialogues."""
    run_dir = Path(run_dir)
    page = (f"<!doctype html>\n<html><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n{markdown_html(md, run_dir)}\n{dialogues_html(dialogues)}\n"
            "</body></html>\n")
    return write_report_file(run_dir / "report.html", page)
