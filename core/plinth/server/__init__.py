"""The OpenAI- and Anthropic-compatible HTTP server (``plinth serve``).

``async_engine`` drives one engine from a worker thread for asyncio; ``state`` holds what every route
shares (settings, state, request checks); ``openai_api`` / ``anthropic_api`` hold the generation routes
and ``app`` the small ones and :func:`~plinth.server.app.build_app`; ``gate`` is the middleware in front
of them all (body limit, drain refusals); ``drain`` the graceful shutdown; ``launch`` runs uvicorn.
Imports go one way: ``app`` -> the route modules -> ``state`` -> ``async_engine``, ``errors``, ``metrics``.
"""

#: ``--max-request-bytes``' default: a 128k-token context is ~0.5 MB of text, JSON escaping can
#: multiply that by 6, and /detokenize takes up to 2**20 ids (~8 MB). Here, not in ``state``, because
#: the CLI's parser reads it and must not import the server (fastapi, the engine, torch) to build.
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
