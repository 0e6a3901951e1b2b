"""Plugins that run a duplexkit session inside voice-agent frameworks (docs/integrations.md).

Each module imports its framework, so import the one you use; this package imports nothing:

* :mod:`duplexkit.integrations.livekit` — a LiveKit Agents realtime model (``pip install 'duplexkit[livekit]'``);
* :mod:`duplexkit.integrations.pipecat` — a Pipecat service.
"""
