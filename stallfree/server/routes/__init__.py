"""The API's routers, one per concern; `build_app` includes them in this order."""
from ..body import parse_bodies_first
from .admin import router as admin
from .chat import router as chat
from .completions import router as completions
from .service import router as service
from .tokens import router as tokens

ROUTERS = (completions, chat, service, tokens, admin)

# Bodies are parsed first, and large ones off the event loop (server/body.py).
for _router in ROUTERS:
    parse_bodies_first(_router)

__all__ = ["ROUTERS"]
