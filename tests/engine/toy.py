"""A small torch-free StageModel used to test the runtime machinery deterministically.

Thinker: speaks when forced (ForceSpeak) or while its turn is open; a turn lasts ``turn_units``
speaking units and the last one ends it (like ``<|turn_eos|>``). Text of a unit: ``"{tag}{n} "``
(tag = the stream's instructions). Talker: 25 codes per unit whose value encodes the tag.
Code2Wav: the real chunk sizes (docs/model.md §7.3: 20160 samples first, 24000 later, the rest on the
last push); sample values encode the reference voice, so cross-talk is visible.
"""

from __future__ import annotations

import threading
import time
import zlib

import numpy as np

from duplexkit.engine.stages import TalkerOut, ThinkerOut, VocoderOut


def tag_value(tag: str) -> float:
    return (zlib.crc32(tag.encode()) % 1000) / 1000.0


class ToyStages:
    model_id = "toy"
    random_weights = True

    def __init__(self, turn_units: int = 3, delay_s: float = 0.002) -> None:
        self.turn_units = turn_units
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.live = {"thinker": 0, "talker": 0, "code2wav": 0}
        self.calls: list = []  # (stage, batch size)
        self.events: list = []  # (what, tag)

    def _count(self, stage: str, d: int) -> None:
        with self.lock:
            self.live[stage] += d

    # thinker
    def thinker_open(self, cfg):
        if cfg.instructions == "fail-open":
            raise RuntimeError("cannot open")
        self._count("thinker", 1)
        return {"tag": cfg.instructions or "x", "units": 0, "turn_open": False, "turn_units": 0}

    def thinker_update(self, h, old, new):
        h["tag"] = new.instructions or "x"
        return h

    def thinker_step(self, items):
        self.calls.append(("thinker", len(items)))
        time.sleep(self.delay_s)
        out = []
        for w in items:
            h = w.handle
            n = h["units"]
            h["units"] += 1
            if w.force_listen or not (w.force_speak or h["turn_open"]):
                out.append(ThinkerOut("listen", n_tokens=1, timings={"prefill_ms": 1.0, "decode_ms": 1.0, "decode_steps": 1}))
                continue
            start = not h["turn_open"]
            h["turn_open"] = True
            h["turn_units"] += 1
            end = h["turn_units"] >= self.turn_units
            if end:
                h["turn_open"] = False
                h["turn_units"] = 0
            out.append(ThinkerOut("speak", text=f"{h['tag']}{n} ", n_tokens=3, turn_start=start, end_of_turn=end,
                                  talker_input=(h["tag"], n), timings={"prefill_ms": 1.0, "decode_ms": 2.0, "decode_steps": 3}))
        return out

    def thinker_end_turn(self, h):
        self.events.append(("end_turn", h["tag"]))
        h["turn_open"] = False
        h["turn_units"] = 0

    def thinker_close(self, h):
        self._count("thinker", -1)

    # talker
    def talker_open(self, seed):
        self._count("talker", 1)
        return {"units": 0}

    def talker_step(self, items):
        self.calls.append(("talker", len(items)))
        time.sleep(self.delay_s)
        out = []
        for w in items:
            tag, _n = w.talker_input
            w.turn["units"] += 1
            out.append(TalkerOut(np.full(25, zlib.crc32(tag.encode()) % 6561, np.int64), steps=26))
        return out

    def talker_close(self, turn):
        self.events.append(("talker_close", None))
        self._count("talker", -1)

    # code2wav
    def code2wav_open(self, voice):
        self._count("code2wav", 1)
        return {"value": tag_value(voice.sha256 if voice is not None else "default"), "buf": 0, "first": True}

    def code2wav_step(self, items):
        self.calls.append(("code2wav", len(items)))
        time.sleep(self.delay_s)
        out = []
        for w in items:
            h = w.handle
            h["buf"] += len(w.codes)
            n = 0
            if w.last:
                n = h["buf"] * 960 + (0 if h["first"] else 3840)
                h["buf"], h["first"] = 0, True
            elif h["buf"] >= 25:
                n = 20160 if h["first"] else 24000
                h["buf"] -= 25
                h["first"] = False
            out.append(VocoderOut(np.full(n, h["value"], np.float32)))
        return out

    def code2wav_end_turn(self, h):
        self.events.append(("c2w_reset", None))
        h["buf"], h["first"] = 0, True

    def code2wav_close(self, h):
        self._count("code2wav", -1)
