"""What every part of a Session shares: the ordered output queue, the phase machine, the epoch and
the clock (:class:`Outbox`). The parts (conversation, input pipeline, responses, settings, tools)
hold no reference to each other's state; they change the outside only through this object."""

from __future__ import annotations

import logging
from typing import Optional

from duplexkit.engine.api import CancelEpoch, EngineCommand
from duplexkit.protocol import ErrorEvent, ErrorInfo, IdFactory, ProtocolError, ServerEvent, SessionWarning
from duplexkit.session.config import CloseConnection, SessionConfig
from duplexkit.session.machine import Phase, PhaseEvent, PhaseMachine

log = logging.getLogger("duplexkit.session")


class Outbox:
    """The outputs and the shared facts of one Session.

    Args:
        cfg: the server-side :class:`SessionConfig`.
        session_id: ``sess_<24 hex>`` (also the engine stream id).
        now_ms: the clock at creation (ms).

    Attributes (read by the parts; written only here and by the Session core):
        cfg, session_id, stream_id, duplex (the profile is ``duplex``), ids (:class:`IdFactory`),
        now_ms (the clock of the latest input), epoch (docs/protocol.md §3; advanced only by
        :meth:`advance_epoch`), machine (the :class:`PhaseMachine`).
    """

    def __init__(self, cfg: SessionConfig, session_id: str, now_ms: float) -> None:
        self.cfg = cfg
        self.session_id = session_id
        self.stream_id = session_id
        self.duplex = cfg.profile == "duplex"
        self.ids = IdFactory()
        self.now_ms = float(now_ms)
        self.epoch = 0
        self.machine = PhaseMachine()
        self._queue: list = []
        self._seq = 0
        self._warned: set = set()  # params that already got a session.warning

    # -- the phase ------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self.machine.phase

    def fire(self, ev: PhaseEvent, event_id: Optional[str] = None) -> Optional[Phase]:
        """Move the phase (:meth:`PhaseMachine.fire`; raises TransitionError where the table says)."""
        return self.machine.fire(ev, event_id)

    def advance_epoch(self) -> None:
        """Epoch + 1 and its ``CancelEpoch`` command (every cancel, barge-in, token cap, failure)."""
        self.epoch += 1
        self.cmd(CancelEpoch(self.stream_id, self.epoch))

    # -- outputs --------------------------------------------------------------------------------
    def emit(self, ev: ServerEvent) -> None:
        """Queue a server event (``event_id``, gap-free ``server_event_seq``). Raises
        :class:`~duplexkit.session.machine.EmissionError` when the phase machine's latest move does
        not declare it (:meth:`PhaseMachine.check_emit`)."""
        self.machine.check_emit(ev.type)
        self._seq += 1
        ev.event_id = self.ids.event()
        ev.server_event_seq = self._seq
        self._queue.append(ev.to_wire())

    def cmd(self, cmd: EngineCommand) -> None:
        self._queue.append(cmd)

    def close_connection(self, code: int, reason: str) -> None:
        self._queue.append(CloseConnection(code, reason))

    def error(self, pe: ProtocolError) -> None:
        """One ``error`` event; its code in the session's naming (:attr:`SessionConfig.error_codes`,
        docs/protocol.md §9)."""
        self.emit(ErrorEvent(error=ErrorInfo(**pe.to_error_dict(self.cfg.wire_error_codes))))

    def warn(self, code: str, message: str, param: str, event_id: Optional[str] = None) -> None:
        """Emit ``session.warning`` once per ``param`` per session.

        ``session.warning`` is an extension event: only the duplex profile sends it (as it sends
        ``response.speak`` and ``response.listen``). The compat profile serves unmodified OpenAI
        clients, which reject event types they do not know (the Agents SDK turns one into an error
        event, Pipecat ends its receive loop), so there the warning is logged by the server only
        (docs/protocol.md §4.1)."""
        if param in self._warned:
            return
        self._warned.add(param)
        self.notice(SessionWarning(code=code, message=message, param=param))

    def notice(self, warning: SessionWarning) -> None:
        """A ``session.warning`` every time (the tool flow's): logged only in the compat profile."""
        if self.duplex:
            self.emit(warning)
        else:
            log.info("session %s: %s (%s): %s", self.session_id, warning.code, warning.param, warning.message)

    def drain(self) -> list:
        out, self._queue = self._queue, []
        return out
