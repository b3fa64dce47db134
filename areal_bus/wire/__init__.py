"""The wire: every message type (``messages``), their msgpack codec (``codec``), the ZeroMQ channels
that carry them (``channels``) and CURVE keys that secure them (``security``). Light: no torch."""
