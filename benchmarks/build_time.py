"""How long the C++ kernel takes to compile, and how much of it is headers.

Compiles, one after the other with the package's flags (``robe_torchrec.ops.cpu.CFLAGS``)
and torch's include paths, to an object file in a temporary directory (no link, no cache):

* each translation unit of the working tree's kernel (``robe_torchrec/ops/csrc/*.cpp``);
* optionally a revision's (``--baseline REV``, e.g. the last pybind11 build);
* a file holding only ``#include <torch/extension.h>`` (what a pybind11 extension pays
  before any of its own code), and one holding only the headers the kernel includes now.

Usage::

    python -m benchmarks.build_time --baseline d2675cd --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from torch.utils.cpp_extension import include_paths

from benchmarks.kernel_ab import baseline_source
from robe_torchrec.pipelines.report import machine, machine_line, write_report
from robe_torchrec.ops import cpu

HEADERS_NOW = ("#include <ATen/Dispatch.h>\n#include <ATen/core/Tensor.h>\n"
               "#include <ATen/ops/empty.h>\n#include <ATen/ops/zeros.h>\n"
               "#include <torch/library.h>\n")
EXTENSION_H = "#include <torch/extension.h>\n"


def compile_seconds(text: str, folder: str, name: str, include: Optional[str] = None) -> float:
    """Wall seconds of ``c++ -c`` on ``text`` with the kernel's flags (its own headers found
    in ``include``)."""
    source = os.path.join(folder, f"{name}.cpp")
    with open(source, "w") as f:
        f.write(text)
    includes = ([f"-I{include}"] if include else []) + [f"-isystem{p}" for p in include_paths()] + [
        f"-isystem{sysconfig.get_paths()['include']}"]
    command = ["c++", "-DTORCH_EXTENSION_NAME=build_time", "-DTORCH_API_INCLUDE_EXTENSION_H",
               "-fPIC", "-std=c++20", *cpu.CFLAGS, *includes, "-c", source,
               "-o", os.path.join(folder, f"{name}.o")]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.build_time",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default=None, help="also compile the kernel at this revision")
    p.add_argument("--out", default=None, help="directory for build_time.{md,json}")
    args = p.parse_args(argv)
    # label: (text, folder of its headers)
    sources: Dict[str, Tuple[str, Optional[str]]] = {}
    for path in cpu._SOURCES:
        if path.endswith(".cpp"):
            with open(path) as f:
                sources[f"{os.path.basename(path)} (working tree)"] = (f.read(), cpu._CSRC)
    load = open("/proc/loadavg").read().split()[0]
    with tempfile.TemporaryDirectory() as folder:
        if args.baseline:
            files, label = baseline_source(args.baseline, None)
            headers = os.path.join(folder, "baseline")
            os.makedirs(headers)
            for name, text in files.items():
                with open(os.path.join(headers, name), "w") as f:
                    f.write(text)
            for name, text in files.items():
                if name.endswith(".cpp"):
                    sources[f"{name} at {label}"] = (text, headers)
        sources["only <torch/extension.h>"] = (EXTENSION_H, None)
        sources["only the headers the kernel includes now"] = (HEADERS_NOW, None)
        seconds = {label: compile_seconds(text, folder, f"unit{i}", include)
                   for i, (label, (text, include)) in enumerate(sources.items())}
    lines = ["# C++ kernel compile time", "",
             f"Command: `python -m benchmarks.build_time {' '.join(sys.argv[1:] if argv is None else argv)}`",
             "", f"Machine: {machine_line()}; load average (1 min) {load} at start.", "",
             f"Each file compiled once, one at a time, with `c++ -c` and the kernel's flags "
             f"(`{' '.join(cpu.CFLAGS)}`) and torch's include paths; wall seconds.", "",
             "| file | seconds |", "| --- | ---: |"]
    lines += [f"| {label} | {s:.1f} |" for label, s in seconds.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_report(args.out, "build_time", {"machine": machine(), "args": vars(args),
                                              "seconds": seconds}, text)


if __name__ == "__main__":
    main()
