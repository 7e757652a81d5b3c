"""MkDocs hook: publish the repository's raw records (``results/``) under ``raw/`` in the site,
so results pages link them (``../raw/xdev/results.jsonl``) and strict mode checks the links.

They are copied as they are: Markdown files among them are not rendered as pages.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[1] / "results"


class RawFile(File):
    """A file copied verbatim, whatever its extension."""

    def is_documentation_page(self) -> bool:
        return False

    def is_static_page(self) -> bool:
        return False

    def is_media_file(self) -> bool:
        return True


def on_files(files, config):
    for path in sorted(p for p in RESULTS.rglob("*") if p.is_file()):
        rel = path.relative_to(RESULTS).as_posix()
        f = RawFile(f"raw/{rel}", src_dir=str(RESULTS.parent), dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"])
        f.abs_src_path = str(path)
        files.append(f)
    return files
