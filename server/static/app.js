// duplexkit browser client: one realtime session over a WebSocket (docs/protocol.md).
//
// Plain JavaScript, no build step. The parts, top to bottom:
//   Player   gapless 24 kHz playback scheduled on an AudioContext; its clock (currentTime minus
//            the output latency) says how much of each response was heard (docs/protocol.md §7.4-7.5).
//   Mic      getUserMedia (echoCancellation, noiseSuppression) -> AudioWorklet -> 20 ms frames of
//            16 kHz pcm16; 5 frames make one 100 ms input_audio_buffer.append (§6.1).
//   Barge    local energy detector: speech over the answer cancels it, flushes the player and
//            reports what was heard with playback.ack{truncate:true} (§7.3).
//   Session  connect, events, states (idle, connecting, listening, speaking, interrupted, error),
//            teardown. Every error releases the microphone and closes the socket.
//   Rtc      the WebRTC transport (docs/webrtc.md): the microphone track and the `oai-events` data
//            channel on an RTCPeerConnection, the offer POSTed to /v1/realtime/calls, the answer
//            played from the remote track. The server paces the audio, reports playback truth and
//            clears the track on barge-in, so Player, Mic capture and Barge are not used then.
// `window.duplexkit` exposes the live state for debugging and for the browser tests.
"use strict";

const INPUT_RATE = 16000;      // Hz, what the page sends (§6.1)
const OUTPUT_RATE = 24000;     // Hz, what the server sends (§6.2)
const FRAMES_PER_APPEND = 5;   // 5 x 20 ms = 100 ms appends (§6.1: 100-200 ms)
const PLAY_LEAD_S = 0.08;      // jitter buffer before the first chunk after an underrun
// cancel races (§7.3), under duplexkit's name and the compat profile's OpenAI name (§9)
const BENIGN_ERRORS = new Set(["response_not_active", "response_cancel_not_active"]);
const BARGE = { onsetFrames: 6, minRms: 0.015, floorRatio: 3.0, hangFrames: 25 };  // 20 ms frames

const $ = (id) => document.getElementById(id);

// ------------------------------------------------------------------------------------ helpers
function bytesToB64(u8) {
  let s = "";
  for (let i = 0; i < u8.length; i += 0x8000) s += String.fromCharCode.apply(null, u8.subarray(i, i + 0x8000));
  return btoa(s);
}
function b64ToPcm16(b64) {
  const bin = atob(b64);
  const n = bin.length >> 1, out = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    let v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
    if (v >= 0x8000) v -= 0x10000;
    out[i] = v / 32768;
  }
  return out;
}
// mono float32 -> 16-bit PCM WAV bytes
function wavBytes(f32, rate) {
  const buf = new ArrayBuffer(44 + f32.length * 2), v = new DataView(buf);
  const str = (o, s) => { for (let i = 0; i < s.length; i++) v.setUint8(o + i, s.charCodeAt(i)); };
  str(0, "RIFF"); v.setUint32(4, 36 + f32.length * 2, true); str(8, "WAVE"); str(12, "fmt ");
  v.setUint32(16, 16, true); v.setUint16(20, 1, true); v.setUint16(22, 1, true);
  v.setUint32(24, rate, true); v.setUint32(28, rate * 2, true); v.setUint16(32, 2, true); v.setUint16(34, 16, true);
  str(36, "data"); v.setUint32(40, f32.length * 2, true);
  for (let i = 0; i < f32.length; i++) {
    const s = Math.max(-1, Math.min(1, f32[i]));
    v.setInt16(44 + 2 * i, s < 0 ? s * 32768 : s * 32767, true);
  }
  return new Uint8Array(buf);
}
// any audio file the browser can decode -> a 16 kHz mono WAV data URL (§8: the server wants WAV)
async function voiceDataUrl(file) {
  const raw = await file.arrayBuffer();
  const tmp = new OfflineAudioContext(1, 1, INPUT_RATE);
  const decoded = await tmp.decodeAudioData(raw);
  const n = Math.ceil(decoded.duration * INPUT_RATE);
  const off = new OfflineAudioContext(1, n, INPUT_RATE);   // downmix + resample natively
  const src = off.createBufferSource(); src.buffer = decoded; src.connect(off.destination); src.start();
  const mono = (await off.startRendering()).getChannelData(0);
  return { url: "data:audio/wav;base64," + bytesToB64(wavBytes(mono, INPUT_RATE)), seconds: mono.length / INPUT_RATE };
}

// ------------------------------------------------------------------------------------ Player
class Player {
  constructor() {
    this.ctx = new AudioContext({ latencyHint: "interactive" });
    this.out = this.ctx.createGain();
    this.out.connect(this.ctx.destination);
    this.next = 0;                 // ctx time where the next chunk starts (gapless)
    this.resp = new Map();         // response id -> {segs:[[start, dur]], sources:Set, samples}
  }
  // the time being heard now: the context clock less the output latency
  now() { return this.ctx.currentTime - (this.ctx.outputLatency || this.ctx.baseLatency || 0); }
  track(id) {
    let r = this.resp.get(id);
    if (!r) { r = { segs: [], sources: new Set(), samples: 0 }; this.resp.set(id, r); }
    return r;
  }
  enqueue(id, f32) {
    if (!f32.length) return;
    const r = this.track(id);
    const buf = this.ctx.createBuffer(1, f32.length, OUTPUT_RATE);
    buf.copyToChannel(f32, 0);
    const src = this.ctx.createBufferSource();
    src.buffer = buf; src.connect(this.out);
    const t = Math.max(this.next, this.ctx.currentTime + PLAY_LEAD_S);
    src.start(t);
    src.onended = () => r.sources.delete(src);
    r.sources.add(src); r.segs.push([t, buf.duration]); r.samples += f32.length;
    this.next = t + buf.duration;
  }
  sentMs(id) { const r = this.resp.get(id); return r ? Math.floor(r.samples * 1000 / OUTPUT_RATE) : 0; }
  // ms of response `id` heard so far (integer, never more than what arrived)
  playedMs(id) {
    const r = this.resp.get(id);
    if (!r) return 0;
    const now = this.now();
    let s = 0;
    for (const [t, d] of r.segs) s += Math.min(Math.max(now - t, 0), d);
    return Math.min(Math.floor(s * 1000 + 1e-6), this.sentMs(id));
  }
  // whether everything that arrived for `id` has been heard
  finished(id) {
    const r = this.resp.get(id);
    if (!r || !r.segs.length) return true;
    const [t, d] = r.segs[r.segs.length - 1];
    return this.now() >= t + d;
  }
  playing(id) { return this.resp.has(id) && !this.finished(id); }
  // stop and drop everything queued for `id`; returns the ms heard before the flush
  flush(id) {
    const played = this.playedMs(id);
    const r = this.resp.get(id);
    if (r) {
      for (const s of r.sources) { try { s.stop(); } catch (e) { /* not started yet */ } }
      r.sources.clear();
      r.segs = [[0, played / 1000]];   // frozen: heard = played from now on
      r.samples = Math.floor(played * OUTPUT_RATE / 1000);
    }
    this.next = 0;
    return played;
  }
  close() { this.ctx.close().catch(() => {}); }
}

// ------------------------------------------------------------------------------------ Mic
class Mic {
  constructor(onFrame) { this.onFrame = onFrame; this.stream = null; this.ctx = null; this.node = null; this.closed = false; }
  check() { if (this.closed) throw new Error("stopped"); }   // close() ran while open() awaited
  async open() {
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    if (this.closed) { stream.getTracks().forEach((t) => t.stop()); this.check(); }
    this.stream = stream;
    let src;
    try {
      this.ctx = new AudioContext({ sampleRate: INPUT_RATE, latencyHint: "interactive" });
      src = this.ctx.createMediaStreamSource(stream);   // the browser resamples to 16 kHz
    } catch (e) {
      // a browser that cannot feed a 16 kHz context from the mic: native low-pass + worklet decimation
      if (this.ctx) this.ctx.close().catch(() => {});
      this.ctx = new AudioContext({ latencyHint: "interactive" });
      src = this.ctx.createMediaStreamSource(stream);
      const lp = this.ctx.createBiquadFilter();
      lp.type = "lowpass"; lp.frequency.value = 7000;
      src.connect(lp); src = lp;
    }
    await this.ctx.audioWorklet.addModule("static/capture-worklet.js");
    this.check();
    this.node = new AudioWorkletNode(this.ctx, "duplexkit-capture", { numberOfInputs: 1, numberOfOutputs: 0 });
    this.node.port.onmessage = (m) => this.onFrame(new Int16Array(m.data.pcm), m.data.rms);
    src.connect(this.node);
    if (this.ctx.state === "suspended") await this.ctx.resume();
  }
  get track() { return this.stream ? this.stream.getAudioTracks()[0] : null; }
  close() {
    this.closed = true;
    if (this.node) { this.node.port.onmessage = null; try { this.node.disconnect(); } catch (e) { /* gone */ } }
    if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    if (this.ctx) this.ctx.close().catch(() => {});
    this.node = null; this.stream = null; this.ctx = null;
  }
}

// ------------------------------------------------------------------------------------ page state
const dk = window.duplexkit = {
  state: "idle", error: null, sessionId: null, ws: null, mic: null, player: null,
  appendsSent: 0, acks: [], responses: [], states: [], micTrack: null,
  transport: "websocket", rtc: null, callId: null, trackEvents: [],
};
let active = null;          // the response being generated: {id, item, el, status}
let frames = [], framesLen = 0;
let vad = { on: false, run: 0, quiet: 0, floor: 0.005 };
let userClosing = false, initEventId = null, lastServerError = null, interruptedTimer = 0, ticker = 0;

function setState(s, detail) {
  if (dk.state !== s) dk.states.push(s);
  dk.state = s;
  const el = $("state");
  el.dataset.state = s;
  el.textContent = detail ? `${s}: ${detail}` : s;
}
function showError(msg) { dk.error = msg; $("error").textContent = msg; setState("error"); }
function note(text) { line("note", text); }
function line(cls, text) {
  const d = document.createElement("div");
  d.className = cls; d.textContent = text;
  $("transcript").appendChild(d); $("transcript").scrollTop = 1e9;
  return d;
}
function send(ev) {
  if (dk.rtc) {
    if (dk.rtc.dc.readyState === "open") { dk.rtc.dc.send(JSON.stringify(ev)); return true; }
    return false;
  }
  if (dk.ws && dk.ws.readyState === WebSocket.OPEN) { dk.ws.send(JSON.stringify(ev)); return true; }
  return false;
}
function findResp(id) { return dk.responses.find((r) => r.id === id); }
function ack(r, played, truncate) {
  const ev = { type: "playback.ack", response_id: r.id, played_ms: played };
  if (r.item) ev.item_id = r.item;
  if (truncate) ev.truncate = true;
  if (send(ev)) dk.acks.push({ response_id: r.id, played_ms: played, truncate: !!truncate, at: performance.now() });
  r.acked = played; r.el.dataset.playedMs = String(played);
}

// a response ended on the server's side without being fully heard, or the user barged in:
// flush the player at once and report what was heard (§7.4)
function cutShort(r, why) {
  if (r.acked !== null) return;
  if (!dk.player) {   // WebRTC: the server cleared its track and finalised the item itself
    r.acked = 0;
    note(`(${why})`);
    setState("interrupted");
    clearTimeout(interruptedTimer);
    interruptedTimer = setTimeout(() => { if (dk.state === "interrupted") setState("listening"); }, 800);
    return;
  }
  const played = dk.player.flush(r.id);
  ack(r, played, true);
  note(`(${why} after ${played} ms)`);
  setState("interrupted");
  clearTimeout(interruptedTimer);
  interruptedTimer = setTimeout(() => { if (dk.state === "interrupted") setState("listening"); }, 800);
}

// ------------------------------------------------------------------------------------ capture
function onFrame(pcm, rms) {
  $("level").value = Math.min(1, rms * 4);
  localVad(rms);
  frames.push(pcm); framesLen += pcm.length;
  if (frames.length < FRAMES_PER_APPEND) return;
  const all = new Int16Array(framesLen);
  let o = 0;
  for (const f of frames) { all.set(f, o); o += f.length; }
  frames = []; framesLen = 0;
  if (dk.sessionId && send({ type: "input_audio_buffer.append", audio: bytesToB64(new Uint8Array(all.buffer)) })) dk.appendsSent++;
}

function localVad(rms) {
  const v = vad, thr = Math.max(BARGE.minRms, v.floor * BARGE.floorRatio);
  if (rms > thr) { v.run++; v.quiet = 0; } else {
    v.quiet++; v.run = 0;
    v.floor = 0.95 * v.floor + 0.05 * rms;   // track the noise floor in silence only
    if (v.on && v.quiet > BARGE.hangFrames) v.on = false;
  }
  if (!v.on && v.run >= BARGE.onsetFrames) { v.on = true; bargeIn(); }
}

function bargeIn() {
  // interrupt the response being generated, or the tail of a finished one still playing
  const r = (active && findResp(active.id)) || dk.responses.find((x) => x.acked === null && dk.player.playing(x.id));
  if (!r || r.acked !== null) return;
  if (active && active.id === r.id) send({ type: "response.cancel", response_id: r.id });
  cutShort(r, "interrupted");
}

// ------------------------------------------------------------------------------------ events
function onEvent(ev) {
  switch (ev.type) {
    case "session.created":
      dk.sessionId = ev.session.id;
      $("voiceInfo").textContent = ev.session.ref_audio
        ? `reference voice ${(ev.session.ref_audio.duration_ms / 1000).toFixed(1)} s (sha256 ${ev.session.ref_audio.sha256.slice(0, 8)})`
        : "(server default voice)";
      note(`connected: ${ev.session.id} (${ev.session.model})`);
      setState("listening");
      break;
    case "input_audio_buffer.speech_started":
      if (dk.state !== "speaking") setState("listening", "you are speaking");
      break;
    case "input_audio_buffer.committed":
      line("user", "you: (spoken turn)").dataset.itemId = ev.item_id;
      break;
    case "conversation.item.input_audio_transcription.completed": {
      const el = [...document.querySelectorAll(".user")].find((x) => x.dataset.itemId === ev.item_id);
      if (el && ev.transcript) el.textContent = "you: " + ev.transcript;
      break;
    }
    case "response.created": {
      const el = line("assistant", "assistant: ");
      el.dataset.responseId = ev.response.id; el.dataset.status = "in_progress"; el.dataset.playedMs = "0";
      const r = { id: ev.response.id, item: null, el, status: "in_progress", acked: null, sentMs: 0 };
      dk.responses.push(r);
      active = r;
      break;
    }
    case "response.output_item.added": {
      const r = findResp(ev.response_id);
      if (r) r.item = ev.item.id;
      break;
    }
    case "response.output_audio.delta": {
      const r = findResp(ev.response_id);
      if (!r || r.acked !== null || r !== active) break;   // flushed or superseded: drop
      r.item = r.item || ev.item_id;
      dk.player.enqueue(r.id, b64ToPcm16(ev.delta));
      r.sentMs = dk.player.sentMs(r.id);
      if (dk.state !== "error") setState("speaking");
      break;
    }
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta": {
      const r = findResp(ev.response_id);
      if (r && r.acked === null) r.el.textContent += ev.delta;
      break;
    }
    case "output_audio_buffer.cleared": {
      if (dk.rtc) dk.trackEvents.push({ type: ev.type, response_id: ev.response_id, at: performance.now() });
      const r = ev.response_id && findResp(ev.response_id);
      if (r) cutShort(r, "cleared");
      break;
    }
    case "response.done": {
      const r = findResp(ev.response.id);
      if (!r) break;
      r.status = ev.response.status; r.el.dataset.status = r.status;
      r.doneAt = performance.now(); r.playedAtDone = dk.player ? dk.player.playedMs(r.id) : null;
      if (active === r) active = null;
      if (r.status === "cancelled") cutShort(r, "interrupted");
      else if (r.status === "failed") {
        const e = (ev.response.status_details || {}).error || {};
        note(`(response failed: ${e.message || e.code || "unknown error"})`);
      }
      // completed / incomplete / failed: the audio that arrived plays out; tick() acks it in full then
      break;
    }
    case "error": {
      const e = ev.error || {};
      if (BENIGN_ERRORS.has(e.code)) { console.debug("duplexkit: benign", e.code, e.message); break; }
      lastServerError = `${e.message || "error"} (${e.code || "?"})`;
      if (!dk.sessionId || (initEventId && e.event_id === initEventId)) {
        fail(lastServerError);             // handshake or setup refused: the session is unusable
      } else {
        note("server error: " + lastServerError);   // a bad event: the session goes on (§9)
      }
      break;
    }
    // WebRTC only (docs/webrtc.md): the server's track started / finished / dropped a response's audio
    case "output_audio_buffer.started":
      dk.trackEvents.push({ type: ev.type, response_id: ev.response_id, at: performance.now() });
      if (dk.state !== "error") setState("speaking");
      break;
    case "output_audio_buffer.stopped": {
      dk.trackEvents.push({ type: ev.type, response_id: ev.response_id, at: performance.now() });
      const r = findResp(ev.response_id);
      if (r && r.acked === null) r.acked = 0;   // heard in full: the server acknowledged it
      if (dk.state === "speaking") setState("listening");
      break;
    }
    case "session.closed":
      if (ev.reason !== "client_close") lastServerError = lastServerError || `session closed by the server (${ev.reason})`;
      break;
  }
}

// played-ms display, and the full-length ack once a response has finished playing (§7.5)
function tick() {
  if (!dk.player) return;
  let playing = false;
  for (const r of dk.responses) {
    if (r.acked !== null) continue;
    const p = dk.player.playedMs(r.id);
    r.el.dataset.playedMs = String(p);
    if (r === active || dk.player.playing(r.id)) playing = true;
    $("played").textContent = String(p);
    if (r.status !== "in_progress" && dk.player.finished(r.id)) {
      const full = dk.player.sentMs(r.id);
      if (full > 0) ack(r, full, false); else r.acked = 0;
    }
  }
  if (dk.state === "speaking" && !playing) setState("listening");
}

// ------------------------------------------------------------------------------------ session
function socketUrl() {
  const u = new URL("v1/realtime", location.href);
  u.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  if ($("profile").value === "duplex") u.searchParams.set("duplex", "1");
  u.searchParams.set("autostart", "0");   // our session.update is applied before session.created
  if ($("model").value) u.searchParams.set("model", $("model").value);
  return u.href;
}

function openSocket(key) {
  return new Promise((resolve, reject) => {
    const protocols = ["realtime"];
    if (key) protocols.push("openai-insecure-api-key." + key);   // browsers cannot set headers (§1.4)
    const ws = new WebSocket(socketUrl(), protocols);
    dk.ws = ws;
    ws.onmessage = (m) => { try { onEvent(JSON.parse(m.data)); } catch (e) { console.error(e); } };
    ws.onopen = () => resolve(ws);
    ws.onclose = (e) => {
      const msg = lastServerError || (e.code === 1006 ? `cannot reach the server at ${location.host}` : `connection closed (${e.code}${e.reason ? ": " + e.reason : ""})`);
      reject(new Error(msg));
      if (dk.ws === ws && !userClosing) fail(msg);
    };
  });
}

async function start() {
  userClosing = false; lastServerError = null; initEventId = null;
  dk.error = null; dk.sessionId = null; dk.appendsSent = 0; dk.acks = []; dk.responses = []; dk.states = []; active = null;
  dk.trackEvents = []; dk.callId = null; dk.transport = $("transport").value;
  $("error").textContent = "";
  $("start").disabled = true; $("stop").disabled = false;
  setState("connecting");
  if (dk.transport === "webrtc") { startRtc(); return; }
  try {
    dk.player = new Player();          // created inside the click: allowed to play
    dk.mic = new Mic(onFrame);
    const voiceFile = $("voice").files[0];
    const voice = voiceFile ? await voiceDataUrl(voiceFile) : null;
    if (userClosing) return;
    // ask for the microphone and open the socket at once; either failing tears both down
    const [ws] = await Promise.all([openSocket($("key").value.trim()), dk.mic.open()]);
    if (userClosing) return;
    dk.micTrack = dk.mic.track;
    await dk.player.ctx.resume();
    initEventId = "init_" + Date.now();
    ws.send(JSON.stringify({ type: "session.update", event_id: initEventId, session: sessionSettings(voice) }));
    ticker = setInterval(tick, 50);
  } catch (e) {
    if (userClosing) return;
    fail(describe(e));
  }
}

// the session settings both transports send (WebSocket: the first session.update; WebRTC: the
// `session` field of the call request, applied before session.created)
function sessionSettings(voice) {
  const session = {
    type: "realtime",
    audio: {
      input: {
        format: { type: "audio/pcm", rate: INPUT_RATE },
        turn_detection: { type: "server_vad", create_response: $("answer").checked, interrupt_response: true },
      },
      output: { format: { type: "audio/pcm", rate: OUTPUT_RATE } },
    },
  };
  if (voice) session.ref_audio = voice.url;
  return session;
}

// ------------------------------------------------------------------------------------ Rtc
// resolves once ICE gathering is complete (the server takes no trickled candidates), or after 3 s
function iceGathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const t = setTimeout(resolve, 3000);
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") { clearTimeout(t); resolve(); }
    });
  });
}

async function startRtc() {
  try {
    const voiceFile = $("voice").files[0];
    const voice = voiceFile ? await voiceDataUrl(voiceFile) : null;
    if (userClosing) return;
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    if (userClosing) { stream.getTracks().forEach((t) => t.stop()); return; }
    const pc = new RTCPeerConnection();
    const audio = document.createElement("audio");
    audio.autoplay = true;
    const dc = pc.createDataChannel("oai-events");
    dk.rtc = { pc, dc, audio, stream };
    dk.mic = { close: () => stream.getTracks().forEach((t) => t.stop()) };
    dk.micTrack = stream.getAudioTracks()[0];
    pc.addTrack(dk.micTrack, stream);
    pc.ontrack = (e) => { audio.srcObject = e.streams[0] || new MediaStream([e.track]); audio.play().catch(() => {}); };
    dc.onmessage = (m) => { try { onEvent(JSON.parse(m.data)); } catch (e) { console.error(e); } };
    dc.onclose = () => { if (dk.rtc && dk.rtc.dc === dc && !userClosing) fail(lastServerError || "the call ended (data channel closed)"); };
    pc.onconnectionstatechange = () => {
      if (pc.connectionState === "failed" && dk.rtc && dk.rtc.pc === pc && !userClosing) fail(`cannot reach the server's media (WebRTC ${pc.connectionState})`);
    };
    await pc.setLocalDescription(await pc.createOffer());
    await iceGathered(pc);
    if (userClosing) return;
    const u = new URL("v1/realtime/calls", location.href);
    if ($("profile").value === "duplex") u.searchParams.set("duplex", "1");
    if ($("model").value) u.searchParams.set("model", $("model").value);
    const form = new FormData();   // OpenAI's unified shape: sdp + session
    form.append("sdp", pc.localDescription.sdp);
    form.append("session", JSON.stringify(sessionSettings(voice)));
    const key = $("key").value.trim();
    let r;
    try {
      r = await fetch(u.href, { method: "POST", body: form, headers: key ? { Authorization: "Bearer " + key } : {} });
    } catch (e) { throw new Error(`cannot reach the server at ${location.host}`); }
    if (r.status !== 201) {
      let msg = `HTTP ${r.status}`;
      try { const e = (await r.json()).error; msg = `${e.message} (${e.code})`; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    dk.callId = (r.headers.get("Location") || "").split("/").pop() || null;
    const answer = await r.text();
    if (userClosing) return;
    await pc.setRemoteDescription({ type: "answer", sdp: answer });
  } catch (e) {
    if (userClosing) return;
    fail(describe(e));
  }
}

function describe(e) {
  if (e && e.name === "NotAllowedError") return "microphone permission denied: allow the microphone for this page and try again";
  if (e && e.name === "NotFoundError") return "no microphone found";
  if (e && e.name === "NotReadableError") return "the microphone is in use by another program";
  if (e && e.name === "EncodingError") return "could not decode the reference-voice file";
  return (e && e.message) || String(e);
}

// release everything: the microphone, the socket, the player
function teardown() {
  clearInterval(ticker); ticker = 0;
  if (dk.mic) dk.mic.close();
  const rtc = dk.rtc;
  dk.rtc = null;
  if (rtc) {   // WebRTC: session.close on the channel, then the peer connection goes (the server ends the call)
    if (rtc.dc.readyState === "open") { try { rtc.dc.send(JSON.stringify({ type: "session.close" })); } catch (e) { /* closing */ } }
    rtc.dc.onclose = null;
    rtc.stream.getTracks().forEach((t) => t.stop());
    rtc.audio.srcObject = null;
    setTimeout(() => rtc.pc.close(), 100);
  }
  const ws = dk.ws;
  dk.ws = null;
  if (ws) {
    if (ws.readyState === WebSocket.OPEN) { try { ws.send(JSON.stringify({ type: "session.close" })); } catch (e) { /* closing */ } }
    if (ws.readyState === WebSocket.OPEN || ws.readyState === WebSocket.CONNECTING) ws.close(1000);
  }
  if (dk.player) dk.player.close();
  dk.mic = null; dk.player = null; dk.sessionId = null; active = null;
  frames = []; framesLen = 0; vad = { on: false, run: 0, quiet: 0, floor: 0.005 };
  $("level").value = 0;
  $("start").disabled = false; $("stop").disabled = true;
}

function fail(msg) {
  if (dk.state === "error" && !dk.ws && !dk.mic) return;
  userClosing = true;    // the close that follows is ours
  teardown();
  showError(msg);
}

function stop() {
  userClosing = true;
  teardown();
  setState("idle");
}

// the model list needs the key (GET /v1/models with a Bearer header works from fetch)
async function loadModels() {
  const key = $("key").value.trim();
  const sel = $("model"), keep = sel.value;
  try {
    const r = await fetch("v1/models", { headers: key ? { Authorization: "Bearer " + key } : {} });
    if (!r.ok) { sel.title = r.status === 401 ? "enter the API key to list models" : `models: HTTP ${r.status}`; return; }
    const ids = (await r.json()).data.map((m) => m.id);
    sel.replaceChildren(new Option("(server default)", ""), ...ids.map((id) => new Option(id, id)));
    if (ids.includes(keep)) sel.value = keep;
    sel.title = "";
  } catch (e) { sel.title = "could not list models"; }
}

// GET /health (no key needed) says whether the served model has random weights (the 'tiny' test
// checkpoint): its answers are gibberish text and noise, which the page says before the user talks
async function loadNotice() {
  try {
    const r = await fetch("health");
    const h = await r.json();
    if (h.status === "loading") { setTimeout(loadNotice, 2000); return; }  // asked again once loaded
    $("notice").textContent = h.random_weights ? RANDOM_WEIGHTS_NOTICE : "";
  } catch (e) { /* the server is down: start() reports it */ }
}
const RANDOM_WEIGHTS_NOTICE = "This server runs a model with RANDOM weights (the 'tiny' test checkpoint): "
  + "the text is gibberish and the speech is noise. Serve a real MiniCPM-o 4.5 checkpoint for real answers.";

$("start").onclick = () => { start(); };
$("stop").onclick = stop;
$("key").addEventListener("change", loadModels);
$("voice").addEventListener("change", () => {
  const f = $("voice").files[0];
  $("voiceInfo").textContent = f ? `${f.name} (sent when you press Start)` : "(server default voice)";
});
window.addEventListener("pagehide", () => { userClosing = true; teardown(); });
loadModels();
loadNotice();
