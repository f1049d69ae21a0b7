"""The HTTP server: OpenAI routes, the native /generate, websocket sessions, admin and
lifecycle routes, and what they share (bodies, errors, limits, the gateway into the engine)."""
