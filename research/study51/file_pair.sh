#!/usr/bin/env bash
# Files what one study51-pair:A,B call returned (the folder `run` copied its $OUT to) under research/data/, as
# research/data/README.md says: research/data/A/ and research/data/B/, each with
#   A-stream.jsonl.gz   the stream, gzip -9 (the returned A-stream.jsonl, byte for byte inside)
#   A-analysis.md, A.log, study51-pair-A.txt   as returned (the analysis also checked against its copy in the pair archive)
#   A-runs.tar.xz       the returned A-runs.tar.gz recompressed with xz -9e (the tar inside byte for byte the same)
#
#   bash research/study51/file_pair.sh /work/.device/N study51-b-s0-c study51-b-s0-d
#
# Refuses (exit 1, nothing half-written) a name whose folder exists, or a call that did not return every file.
# STUDY_DATA: where to file (default research/data; the tests file elsewhere).
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 RETURNED_DIR LIST_A LIST_B" >&2; exit 2; }
returned=$1; shift
data=${STUDY_DATA:-$(cd "$(dirname "$0")/../.." && pwd)/research/data}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
[ -f "$returned/study51-pair.tar.gz" ] || { echo "$returned: no study51-pair.tar.gz" >&2; exit 1; }
tar xzf "$returned/study51-pair.tar.gz" -C "$work"
for name in "$@"; do
  [ ! -e "$data/$name" ] || { echo "$data/$name exists: not overwritten" >&2; exit 1; }
  for f in "$returned/$name-stream.jsonl" "$returned/$name-analysis.md" "$work/$name-analysis.md" "$work/$name.log" \
           "$work/$name-runs.tar.gz" "$work/study51-pair-$name.txt"; do
    [ -f "$f" ] || { echo "$f: not returned" >&2; exit 1; }
  done
  cmp -s "$returned/$name-analysis.md" "$work/$name-analysis.md" || { echo "$name-analysis.md: the two copies differ" >&2; exit 1; }
done
for name in "$@"; do
  stage="$work/stage-$name"; mkdir -p "$stage"
  gzip -9 -c "$returned/$name-stream.jsonl" > "$stage/$name-stream.jsonl.gz"
  cp "$work/$name-analysis.md" "$work/$name.log" "$work/study51-pair-$name.txt" "$stage/"
  gzip -dc "$work/$name-runs.tar.gz" | xz -9e > "$stage/$name-runs.tar.xz"
done
for name in "$@"; do  # moved once both are staged
  mv "$work/stage-$name" "$data/$name"
  echo "filed $data/$name: $(ls "$data/$name" | tr '\n' ' ')"
done
