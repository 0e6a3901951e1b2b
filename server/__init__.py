"""duplexkit's bundled server (installed as ``duplexkit_server``): FastAPI + uvicorn.

``create_app(engine, ServerSettings(...))`` builds the app; ``serve(app, host, port)`` runs it with
the transport limits and graceful shutdown of docs/protocol.md §1. See ``duplexkit serve --help``.
"""

from .app import ServerSettings, ServerState, create_app, serve

__all__ = ["ServerSettings", "ServerState", "create_app", "serve"]
