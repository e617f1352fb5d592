#!/usr/bin/python3
"""Builds data/workloads/code-corpus.txt: the sizes, in tokens, of the source and documentation
files of a Debian 12 machine (Python's standard library and dist-packages, /usr/include,
/usr/share/doc), one document per line, for `--workload data/workloads/code-corpus.txt`.

Tokens are bytes / 4 (a common rule of thumb for BPE tokenizers on code and English), at least 1.
Documents over 512K tokens are cut to 512K, the paper's maximum sequence length. Files are
visited in sorted order and symbolic links skipped, so one machine gives one list; another
machine's packages give a similar but not identical one (the committed file is the one used).

Usage: /usr/bin/python3 data/workloads/make_code_corpus.py > data/workloads/code-corpus.txt
"""
import os
import sys

ROOTS = ["/usr/lib/python3.11", "/usr/lib/python3/dist-packages", "/usr/include", "/usr/share/doc"]
EXTENSIONS = (".py", ".h", ".hpp", ".c", ".cc", ".md", ".txt", ".rst", ".html")
MAX_TOKENS = 512 * 1024


def sizes():
    for root in ROOTS:
        for directory, subdirs, files in os.walk(root):
            subdirs.sort()
            for name in sorted(files):
                path = os.path.join(directory, name)
                if not name.endswith(EXTENSIONS) or os.path.islink(path):
                    continue
                size = os.path.getsize(path)
                if size > 0:
                    yield min(MAX_TOKENS, max(1, size // 4))


def main():
    lengths = list(sizes())
    lengths_sorted = sorted(lengths)
    n = len(lengths)
    out = sys.stdout
    out.write("# Document sizes in tokens (bytes / 4, cut to 512K) of %d source and documentation\n" % n)
    out.write("# files of a Debian 12 machine; built by data/workloads/make_code_corpus.py.\n")
    out.write("# median %d, p90 %d, p99 %d, max %d tokens; %d tokens in all.\n" % (
        lengths_sorted[n // 2], lengths_sorted[int(0.9 * n)], lengths_sorted[int(0.99 * n)],
        lengths_sorted[-1], sum(lengths)))
    for length in lengths:
        out.write("%d\n" % length)


if __name__ == "__main__":
    main()
