// duplexkit capture worklet: microphone -> 20 ms frames of 16 kHz mono pcm16 (docs/protocol.md §6.1).
//
// Runs on the audio rendering thread. The page normally creates its capture AudioContext at
// 16 000 Hz, so the browser's own resampler does the rate conversion and `ratio` is 1. When the
// browser refuses a 16 kHz context for the microphone, the page low-passes the signal with a
// native BiquadFilterNode and this worklet decimates it by linear interpolation.
//
// Each posted message is {pcm: ArrayBuffer (320 x int16 little-endian), rms: float in [0, 1]}.

const TARGET_RATE = 16000;
const FRAME = 320; // samples per frame: 20 ms at 16 kHz

class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ratio = sampleRate / TARGET_RATE; // input samples per output sample
    this.pos = 0;                          // fractional read position into the current block
    this.last = 0;                         // last sample of the previous block (interpolation)
    this.frame = new Float32Array(FRAME);
    this.n = 0;
  }

  push(v) {
    this.frame[this.n++] = v;
    if (this.n === FRAME) {
      const pcm = new Int16Array(FRAME);
      let e = 0;
      for (let i = 0; i < FRAME; i++) {
        const s = Math.max(-1, Math.min(1, this.frame[i]));
        e += s * s;
        pcm[i] = s < 0 ? Math.round(s * 32768) : Math.round(s * 32767);
      }
      this.port.postMessage({ pcm: pcm.buffer, rms: Math.sqrt(e / FRAME) }, [pcm.buffer]);
      this.n = 0;
    }
  }

  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    if (!ch || ch.length === 0) return true;
    if (this.ratio === 1) {
      for (let i = 0; i < ch.length; i++) this.push(ch[i]);
      return true;
    }
    // sample k of the virtual signal [last, ch[0], ch[1], ...] sits at index k - 1 of ch
    let p = this.pos;
    while (p < ch.length) {
      const i = Math.floor(p), f = p - i;
      const a = i === 0 ? this.last : ch[i - 1];
      this.push(a + (ch[i] - a) * f);
      p += this.ratio;
    }
    this.pos = p - ch.length;
    this.last = ch[ch.length - 1];
    return true;
  }
}

registerProcessor("duplexkit-capture", CaptureProcessor);
