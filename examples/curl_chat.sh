#!/usr/bin/env bash
# Chat completions with curl: text in, text + a 24 kHz WAV out (docs/protocol.md §10).
#
#   duplexkit serve tiny --port 8000
#   examples/curl_chat.sh http://127.0.0.1:8000 "Tell me a joke" answer.wav
#
# Needs curl and python3 (to pick the audio choice by message.audio.data and decode it).
# No max_tokens is sent: the server's default applies, which keeps its --max-output-tokens cap
# (40 tokens with tiny), so a random-weight answer takes seconds, not minutes.
# Set DUPLEXKIT_API_KEY if the server has a key.
set -euo pipefail
URL="${1:-http://127.0.0.1:8000}"
TEXT="${2:-Hello! Who are you?}"
OUT="${3:-answer.wav}"
AUTH=()
if [[ -n "${DUPLEXKIT_API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer ${DUPLEXKIT_API_KEY}"); fi

echo "== health"
HEALTH=$(curl -sS "$URL/health")
echo "$HEALTH"
python3 -c 'import json, sys
if json.loads(sys.argv[1]).get("random_weights"):
    print("NOTE: the server'"'"'s model has RANDOM weights (the '"'"'tiny'"'"' test checkpoint): the text is gibberish and "
          "the speech is noise. Use a real MiniCPM-o 4.5 checkpoint directory for real answers.", file=sys.stderr)
' "$HEALTH" || true
echo "== models"
curl -sS "${AUTH[@]}" "$URL/v1/models"; echo

BODY=$(python3 -c 'import json,sys; print(json.dumps({"messages":[{"role":"user","content":sys.argv[1]}],
  "modalities":["text","audio"],"audio":{"format":"wav"}}))' "$TEXT")

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
  "stream":True,"modalities":["text"]}))' "$TEXT")
curl -sSN "${AUTH[@]}" -H "Content-Type: application/json" -d "$STREAM_BODY" "$URL/v1/chat/completions"
