#!/usr/bin/env bash
# What code a device run ran, for its commit.txt: $COMMIT when the caller names it (the device copy's .git can be
# older than the working tree it carries: the GPU machine copies the tree, and its HEAD was seen to be the
# checkout's base, not the commits made on top of it), else the copy's HEAD and how many files differ from it.
# Usage: bash device/commit_stamp.sh > "$OUT/commit.txt"
set -u
head=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ -n "${COMMIT:-}" ]; then
  echo "$COMMIT (named by the caller; the device copy's HEAD is $head)"
  exit 0
fi
changed=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
if [ "$changed" -eq 0 ]; then
  echo "$head"
else
  echo "$head + $changed tracked files that differ from it (the device copy's HEAD lags the carried tree: name the commit with COMMIT=...)"
fi
