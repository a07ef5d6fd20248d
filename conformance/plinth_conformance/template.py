"""``plinth plugin new``: render the backend plugin template with copier.

The template lives in the repository's ``plugin_template/`` (``copier.yml`` + ``template/``). It is
rendered from the local directory (no git checkout needed); the rendered plugin keeps its answers
in ``.copier-answers.yml`` so ``copier update`` can pull later template changes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

#: Overrides where the template is looked for (a directory or a git URL copier understands).
TEMPLATE_ENV = "PLINTH_PLUGIN_TEMPLATE"

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class TemplateNotFound(FileNotFoundError):
    """No plugin template where one was looked for."""


def default_template() -> str:
    """``$PLINTH_PLUGIN_TEMPLATE``, else the ``plugin_template/`` next to this source tree."""
    if env := os.environ.get(TEMPLATE_ENV):
        return env
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "plugin_template"
        if (candidate / "copier.yml").is_file():
            return str(candidate)
    raise TemplateNotFound(
        "plinth's plugin template was not found next to this installation (it ships in the source "
        f"repository as plugin_template/); pass --template PATH_OR_GIT_URL or set ${TEMPLATE_ENV}"
    )


def render_plugin(name: str, dest_dir: Path, template: str | None = None, data: dict[str, Any] | None = None) -> Path:
    """Render a plugin for backend ``name`` into ``dest_dir/plinth-NAME``; returns that directory.

    :param template: a template directory or git URL (default: :func:`default_template`).
    :param data: further template answers (``package_name``, ``description``, ...).
    :raises ValueError: ``name`` is not a lowercase identifier, or the target exists.
    """
    if not _NAME.match(name):
        raise ValueError(f"backend name {name!r}: use lowercase letters, digits and _, starting with a letter")
    import copier

    from plinth.hookspecs import api_version_string

    # the rendered plugin declares the API of the plinth rendering it, read from the contract
    answers = {"backend_name": name, "plugin_api_version": api_version_string(), **(data or {})}
    dist = answers.get("distribution_name") or f"plinth-{name.replace('_', '-')}"
    target = Path(dest_dir) / str(dist)
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"{target} already exists and is not empty")
    copier.run_copy(
        template or default_template(),
        str(target),
        data=answers,
        defaults=True,  # every other question has a default: never prompt
        unsafe=True,  # our own template; it runs no tasks, but copier asks for trust of any template
        quiet=True,
    )
    return target
