#!/usr/bin/env bash
# Chat completions with curl: text in, text + a 24 kHz WAV out (docs/protocol.md §10).
#
#   duplexkit serve tiny --port 8000
#   examples/curl_chat.sh http://127.0.0.1:8000 "Tell me a joke" answer.wav
#
# Needs curl and python3 (to pick the audio choice by message.audio.data and decode it).
# Set DUPLEXKIT_API_KEY if the server has a key.
set -euo pipefail
URL="${1:-http://127.0.0.1:8000}"
TEXT="${2:-Hello! Who are you?}"
OUT="${3:-answer.wav}"
AUTH=()
if [[ -n "${DUPLEXKIT_API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer ${DUPLEXKIT_API_KEY}"); fi

echo "== health"
curl -sS "$URL/health"; echo
echo "== models"
curl -sS "${AUTH[@]}" "$URL/v1/models"; echo

BODY=$(python3 -c 'import json,sys; print(json.dumps({"messages":[{"role":"user","content":sys.argv[1]}],
  "modalities":["text","audio"],"audio":{"format":"wav"},"max_tokens":64}))' "$TEXT")

echo "== chat (non-stream)"
curl -sS "${AUTH[@]}" -H "Content-Type: application/json" -d "$BODY" "$URL/v1/chat/completions" \
  | python3 -c '
import base64, json, sys
data = json.load(sys.stdin)
if "error" in data:
    sys.exit("error: %s" % data["error"])
for ch in data["choices"]:
    msg = ch["message"]
    if (msg.get("audio") or {}).get("data"):
        open(sys.argv[1], "wb").write(base64.b64decode(msg["audio"]["data"]))
        print("audio ->", sys.argv[1], "| transcript:", msg["audio"]["transcript"])
    elif msg.get("content"):
        print("text:", msg["content"])
print("usage:", data["usage"])
' "$OUT"

echo "== chat (stream, text only)"
STREAM_BODY=$(python3 -c 'import json,sys; print(json.dumps({"messages":[{"role":"user","content":sys.argv[1]}],
  "stream":True,"max_tokens":32}))' "$TEXT")
curl -sSN "${AUTH[@]}" -H "Content-Type: application/json" -d "$STREAM_BODY" "$URL/v1/chat/completions"
