#!/usr/bin/env python3
"""One line per kernel of a CUDA build: a digest of its SASS instruction text,
its instruction count, its resource usage and its demangled name.

For refactors that must not change the code a GPU runs: digest the build
before and after and compare the digests with the names left out
(`--no-names`, since a refactor may rename a kernel). Needs cuobjdump
(CUDA's, on PATH, or named by CUOBJDUMP; `pip install nvidia-cuda-cuobjdump`
ships one) and c++filt.

  scripts/sass_digest.py build-cuda > before.txt
  ... change the code, rebuild ...
  scripts/sass_digest.py build-cuda > after.txt
  scripts/sass_digest.py --no-names build-cuda | diff <(cut -d' ' -f1-3 before.txt | sort) -
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys


def objects(paths):
    for path in paths:
        if os.path.isdir(path):
            for root, _, files in os.walk(path):
                for name in sorted(files):
                    if name.endswith(".cu.o"):
                        yield os.path.join(root, name)
        else:
            yield path


def run(tool, *args):
    return subprocess.run([tool, *args], check=True, capture_output=True, text=True).stdout


def kernels(tool, obj):
    """(mangled name, instruction lines) per kernel; addresses kept (they are relative)."""
    out, name, body = {}, None, []
    for line in run(tool, "-sass", obj).splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                out[name] = body
            name, body = m.group(1), []
        elif name and re.search(r"/\*[0-9a-f]{4,}\*/", line):
            body.append(" ".join(line.split()))
    if name:
        out[name] = body
    return out


def resources(tool, obj):
    usage, name = {}, None
    for line in run(tool, "-res-usage", obj).splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
        elif name and "REG:" in line:
            usage[name] = "/".join(f"{k}{v}" for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line))
            name = None
    return usage


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="CUDA objects (.cu.o) or build folders to search for them")
    ap.add_argument("--no-names", action="store_true", help="leave the kernels' names out, sorted by digest")
    args = ap.parse_args()
    tool = os.environ.get("CUOBJDUMP", "cuobjdump")
    rows = []
    for obj in objects(args.paths):
        usage = resources(tool, obj)
        for name, body in kernels(tool, obj).items():
            digest = hashlib.sha1("\n".join(body).encode()).hexdigest()[:16]
            rows.append((digest, str(len(body)), usage.get(name, "-"), os.path.basename(obj), name))
    if not rows:
        sys.exit("sass_digest: no kernels found (is this a CUDA build?)")
    if args.no_names:
        for row in sorted(rows):
            print(" ".join(row[:3]))
        return
    names = run("c++filt", *[r[4] for r in rows]).splitlines()
    for row, name in zip(rows, names):
        print(" ".join(row[:4]), name)


if __name__ == "__main__":
    main()
