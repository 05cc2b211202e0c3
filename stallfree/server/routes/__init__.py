"""The API's routers, one per concern; `build_app` includes them in this order."""
from .admin import router as admin
from .chat import router as chat
from .completions import router as completions
from .service import router as service
from .tokens import router as tokens

ROUTERS = (completions, chat, service, tokens, admin)

__all__ = ["ROUTERS"]
