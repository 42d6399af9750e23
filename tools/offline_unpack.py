#!/usr/bin/env python3
"""Reassemble a bundle made by offline_bundle.py on the offline host (Python stdlib only).

    python3 offline_unpack.py --stash /tmp/wcstage PART [PART ...]        # copy parts in, sha256-checked
    python3 offline_unpack.py --stash /tmp/wcstage --extract /tmp/site    # once every part is there
    python3 offline_unpack.py --stash /tmp/wcstage --status

PART is a part file or its folder (pNN/, which holds manifest.json beside the part). Stashing a part
that is already there (same sha256) does nothing; extracting a bundle already extracted does nothing.
Each bundle has its own folder in the stash, named after its archive's digest. The last line printed
after an extract is the PYTHONPATH to export.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

MIB = 1 << 20
FORMAT = 1
MARKER = ".offline-bundle.json"


class UnpackError(Exception):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MIB):
            h.update(chunk)
    return h.hexdigest()


def load_manifest(path: Path) -> dict:
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise UnpackError(f"no manifest.json at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnpackError(f"{path} is not a bundle manifest: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or "parts" not in m:
        raise UnpackError(f"{path} is not a format-{FORMAT} bundle manifest")
    return m


def bundle_dir(stash: Path, manifest: dict) -> Path:
    return stash / f"{manifest['name']}-{manifest['archive_sha256'][:12]}"


def copy_checked(src: Path, dest: Path, sha256: str, size: int | None) -> str:
    """Copy src to dest through a temporary name; refuse (and leave nothing) if the digest differs."""
    if dest.exists() and dest.stat().st_size == (size if size is not None else dest.stat().st_size) \
            and sha256_file(dest) == sha256:
        return "already stashed"
    tmp = dest.with_name(dest.name + ".partial")
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        while chunk := fin.read(4 * MIB):
            h.update(chunk)
            fout.write(chunk)
    if h.hexdigest() != sha256:
        tmp.unlink()
        raise UnpackError(f"{src} is corrupt: sha256 {h.hexdigest()[:16]}..., the manifest says {sha256[:16]}...")
    tmp.replace(dest)
    return "stashed"


def stash_part(stash: Path, given: Path) -> str:
    given = Path(given)
    if given.is_dir():
        manifest_path = given / "manifest.json"
        manifest = load_manifest(manifest_path)
        names = {Path(p["file"]).name for p in manifest["parts"]} | {Path(a["file"]).name for a in manifest.get("aux", [])}
        files = sorted(p for p in given.iterdir() if p.name in names)
        if not files:
            raise UnpackError(f"{given} holds no part of bundle {manifest['name']}")
    elif given.is_file():
        manifest_path = given.parent / "manifest.json"
        manifest = load_manifest(manifest_path)
        files = [given]
    else:
        raise UnpackError(f"no such part: {given}")
    home = bundle_dir(stash, manifest)
    home.mkdir(parents=True, exist_ok=True)
    mine = home / "manifest.json"
    if not mine.exists() or load_manifest(mine) != manifest:
        shutil.copyfile(manifest_path, mine)
    by_name = {Path(p["file"]).name: p for p in [*manifest["parts"], *manifest.get("aux", [])]}
    lines = []
    for f in files:
        entry = by_name.get(f.name)
        if entry is None:
            raise UnpackError(f"{f.name} is not a part of bundle {manifest['name']} (see {manifest_path})")
        what = copy_checked(f, home / f.name, entry["sha256"], entry.get("bytes"))
        lines.append(f"{what}: {f.name} ({entry.get('bytes', 0) / MIB:.1f} MiB)")
    have, total = present_parts(home, manifest)
    lines.append(f"bundle {manifest['name']}: {len(have)}/{total} parts in {home}")
    return "\n".join(lines)


def present_parts(home: Path, manifest: dict) -> tuple[list[int], int]:
    have = [p["index"] for p in manifest["parts"]
            if (home / Path(p["file"]).name).exists()
            and (home / Path(p["file"]).name).stat().st_size == p["bytes"]]
    return have, len(manifest["parts"])


def find_bundle(stash: Path, name: str | None) -> tuple[Path, dict]:
    """The stashed bundle to extract: the one named (NAME or NAME-DIGEST), else the only one, else the
    only complete one."""
    homes = sorted(p.parent for p in stash.glob("*/manifest.json")) if stash.is_dir() else []
    if name:
        homes = [h for h in homes if name in (h.name, h.name.rsplit("-", 1)[0])]
    if not homes:
        raise UnpackError(f"no bundle stashed in {stash}" + (f" named {name}" if name else "") + ": stash its parts first")
    found = [(h, load_manifest(h / "manifest.json")) for h in homes]
    if len(found) > 1:
        complete = [(h, m) for h, m in found if len(present_parts(h, m)[0]) == len(m["parts"])]
        if len(complete) == 1:
            return complete[0]
        listing = ", ".join(f"{h.name} ({len(present_parts(h, m)[0])}/{len(m['parts'])} parts)" for h, m in found)
        raise UnpackError(f"{stash} holds several bundles: {listing}; pass --name NAME-DIGEST "
                          "(parts of different builds do not mix)")
    return found[0]


class ChainReader:
    """Reads the parts one after another as one stream, hashing what passes through."""

    def __init__(self, paths: list[Path]):
        self.paths = list(paths)
        self.current = None
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            if self.current is None:
                if not self.paths:
                    break
                self.current = open(self.paths.pop(0), "rb")
            chunk = self.current.read(-1 if n < 0 else n - len(out))
            if not chunk:
                self.current.close()
                self.current = None
                continue
            out += chunk
        self.hash.update(out)
        return bytes(out)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if self.current is not None:
            self.current.close()


def decompressor(manifest: dict, home: Path, raw):
    codec = manifest["codec"]
    if codec == "xz":
        import lzma

        return lzma.LZMAFile(raw, "rb")
    if codec == "zstd":
        sys.path.insert(0, str(zstandard_path(manifest, home)))
        import zstandard

        window = 1 << max(int(manifest.get("zstd_window_log") or 27), 27)
        return zstandard.ZstdDecompressor(max_window_size=window).stream_reader(raw, read_across_frames=True)
    raise UnpackError(f"unknown codec {codec!r} in the manifest")


def zstandard_path(manifest: dict, home: Path) -> Path:
    aux = [a for a in manifest.get("aux", []) if a.get("role") == "zstandard"]
    if not aux:
        raise UnpackError("the manifest names no zstandard wheel for its zstd archive")
    wheel = home / Path(aux[0]["file"]).name
    if not wheel.exists():
        raise UnpackError(f"missing {wheel.name} (it travels in part 1): stash part 1 first")
    dest = home / "_zstandard"
    if not (dest / ".done").exists():
        if sha256_file(wheel) != aux[0]["sha256"]:
            raise UnpackError(f"{wheel} is corrupt")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(dest)
        (dest / ".done").write_text("")
    return dest


def extract(stash: Path, dest: Path, name: str | None = None) -> str:
    home, manifest = find_bundle(stash, name)
    marker = dest / MARKER
    if marker.exists():
        try:
            done = json.loads(marker.read_text())
        except json.JSONDecodeError:
            done = {}
        if done.get("archive_sha256") == manifest["archive_sha256"]:
            return f"already extracted: {manifest['name']} in {dest}"
        raise UnpackError(f"{dest} holds another bundle ({done.get('name')}): remove it or pick another --extract")
    if dest.exists() and any(dest.iterdir()):
        raise UnpackError(f"{dest} exists and is not empty: remove it or pick another --extract")
    have, total = present_parts(home, manifest)
    missing = [p for p in manifest["parts"] if p["index"] not in have]
    if missing:
        p = missing[0]
        raise UnpackError(f"missing part {p['index']} of {total} ({p['file']}); stashed: {have or 'none'}")
    paths = [home / Path(p["file"]).name for p in manifest["parts"]]
    for p, path in zip(manifest["parts"], paths, strict=True):
        if sha256_file(path) != p["sha256"]:
            raise UnpackError(f"stashed part {p['index']} ({path}) is corrupt: stash it again")
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    raw = ChainReader(paths)
    try:
        with decompressor(manifest, home, raw) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:  # pragma: no cover - Python < 3.12
                tar.extractall(tmp)
        while raw.read(4 * MIB):  # the tail after the tar's end, so the digest covers every byte
            pass
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UnpackError(f"the archive of {manifest['name']} did not unpack: {type(e).__name__}: {e}") from None
    finally:
        raw.close()
    if raw.hash.hexdigest() != manifest["archive_sha256"]:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UnpackError("the reassembled archive's sha256 differs from the manifest's")
    (tmp / MARKER).write_text(json.dumps({"name": manifest["name"], "archive_sha256": manifest["archive_sha256"]}))
    if dest.exists():
        dest.rmdir()
    tmp.rename(dest)
    return f"extracted {manifest['name']}: {manifest['files']} files, {manifest['tar_bytes'] / MIB:.0f} MiB into {dest}"


def status(stash: Path) -> str:
    homes = sorted(p.parent for p in stash.glob("*/manifest.json")) if stash.is_dir() else []
    if not homes:
        return f"no bundle stashed in {stash}"
    lines = []
    for home in homes:
        m = load_manifest(home / "manifest.json")
        have, total = present_parts(home, m)
        lines.append(f"{home.name}: {len(have)}/{total} parts {have}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="offline_unpack.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--stash", type=Path, required=True, help="where parts wait for the others (e.g. /tmp/wcstage)")
    ap.add_argument("--extract", type=Path, help="unpack the complete bundle into this folder")
    ap.add_argument("--name", help="which bundle, when the stash holds several")
    ap.add_argument("--status", action="store_true", help="list the stashed bundles and their parts")
    ap.add_argument("parts", nargs="*", type=Path)
    args = ap.parse_args(argv)
    try:
        for part in args.parts:
            print(stash_part(args.stash, part))
        if args.status:
            print(status(args.stash))
        if args.extract:
            print(extract(args.stash, args.extract, args.name))
            dest = args.extract.resolve()
            print(f"export PYTHONPATH={dest}${{PYTHONPATH:+:$PYTHONPATH}}")
        if not (args.parts or args.status or args.extract):
            ap.error("nothing to do: give parts to stash, --extract DIR or --status")
    except UnpackError as e:
        print(f"offline_unpack: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
