#!/usr/bin/env bash
# Puts the tinyshakespeare corpus (1.1 MB of text) at data/tinyshakespeare.txt: copied from
# ../shared/data when that folder is beside the repository, else downloaded (char-rnn's copy).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/data/tinyshakespeare.txt"
mkdir -p "$root/data"
if [ -s "$dest" ]; then
  echo "data ready: $dest"
  exit 0
fi
shared="$root/../shared/data/tinyshakespeare.txt"
if [ -s "$shared" ]; then
  cp "$shared" "$dest"
  echo "copied $shared -> $dest"
  exit 0
fi
url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
echo "downloading $url"
tmp="$dest.partial"
offline() {
  rm -f "$tmp"
  echo "error: could not download the corpus (no network?). Put any UTF-8 text file at $dest (tinyshakespeare: $url), or run fsdp train with --data FILE" >&2
  exit 1
}
if command -v curl >/dev/null 2>&1; then
  curl -fsSL "$url" -o "$tmp" || offline
else
  python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$url" "$tmp" || offline
fi
mv "$tmp" "$dest"
echo "data ready: $dest"
