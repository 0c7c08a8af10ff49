"""Chat templates compiled as transformers compiles them, before anything is written: a template with a Jinja syntax
error is refused in one line naming where it came from, instead of being written into the output and failing at the
merged model's first ``apply_chat_template``."""

from __future__ import annotations

from typing import Any

from ram_trl.errors import ConfigError

__all__ = ["check_chat_template"]


def _environment() -> Any:
    """A sandboxed environment with transformers' options, extensions and filters (``{% generation %}`` blocks,
    loop controls, ``tojson``), for compiling only."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = lambda value, **_: value
    return environment


def check_chat_template(template: str, origin: str, where: str) -> str:
    """Compile a chat template as transformers does and return it unchanged."""
    import jinja2

    try:
        _environment().from_string(template)
    except jinja2.TemplateError as exc:
        line = getattr(exc, "lineno", None)
        detail = " ".join(str(exc.message or exc).split())
        at = f" at line {line}" if line else ""
        raise ConfigError(
            f"{where}: the chat template from {origin} does not compile{at} ({detail}); fix the template or choose "
            "another"
        ) from None
    return template
