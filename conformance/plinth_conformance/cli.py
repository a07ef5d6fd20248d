"""``plinth conformance`` and ``plinth plugin new``: the command-line side of the suite.

``plinth conformance --backend NAME`` runs :mod:`plinth_conformance.suite` through ``pytest.main``
with this package's plugin options, so the exit status is pytest's (0 only when every selected case
passed). ``--matrix`` rebuilds the support matrix from certificates instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: Where the suite's test modules live (inside the package, so they ship with it).
SUITE_DIR = Path(__file__).resolve().parent / "suite"


def suite_args(
    backend: str,
    tier: str = "extended",
    report: str | Path | None = None,
    keyword: str | None = None,
    extra: list[str] | None = None,
    note: str | None = None,
) -> list[str]:
    """The pytest arguments of one conformance run (also what tests pass to ``pytester``)."""
    args = [
        str(SUITE_DIR),
        f"--plinth-backend={backend}",
        f"--plinth-tier={tier}",
        f"--rootdir={SUITE_DIR}",
        "-p",
        "no:cacheprovider",  # never write a .pytest_cache into site-packages
        "-q",
        "-rfE",
        # plinth (and this plugin) are imported before pytest starts: nothing to rewrite there
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
    ]
    if report is not None:
        report = Path(report)
        args += [f"--plinth-report={report}", f"--junitxml={report / 'junit.xml'}"]
    if keyword:
        args += ["-k", keyword]
    if note:
        args.append(f"--plinth-note={note}")
    return args + list(extra or [])


def cmd_conformance(args: argparse.Namespace) -> int:
    """Run the suite against ``--backend`` (or build the support matrix with ``--matrix``)."""
    if args.matrix:
        from plinth_conformance.matrix import write_matrix

        path = write_matrix(Path(args.certs), Path(args.out))
        print(f"wrote {path} from the certificates in {args.certs}")
        return 0
    if not args.backend:
        print("plinth conformance: error: --backend NAME is required (or --matrix)")
        return 2
    try:
        import pytest
    except ImportError:  # pytest is an optional dependency of plinth
        print("plinth conformance: error: the suite needs pytest: pip install 'plinth[conformance]'")
        return 2
    # With -k a single case is usually asked for: look for it in every tier unless told otherwise.
    tier = args.tier or ("all" if args.keyword else "extended")
    extra = (["-x"] if args.exitfirst else []) + list(args.pytest_args or [])
    return int(pytest.main(suite_args(args.backend, tier, args.report, args.keyword, extra, args.note)))


def cmd_plugin_new(args: argparse.Namespace) -> int:
    """Render a backend plugin from the template."""
    from plinth_conformance.template import render_plugin

    dest = render_plugin(args.name, Path(args.dest), template=args.template, data=dict(args.set or []))
    print(f"created {dest}")
    print(f"next: pip install -e {dest} && plinth conformance --backend {args.name} --tier core")
    return 0


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Add ``conformance`` and ``plugin new`` to the ``plinth`` command's subparsers."""
    conf = sub.add_parser("conformance", help="certify a backend with the conformance suite")
    conf.add_argument("--backend", default=None, help="backend name to certify")
    conf.add_argument(
        "--tier",
        choices=["core", "extended", "perf", "collectives", "all"],
        default=None,
        help="core; extended (= core + extended, the default); perf; collectives (2 ranks); all",
    )
    conf.add_argument("--report", default=None, metavar="DIR", help="JUnit XML, certificate.json, summary.md")
    conf.add_argument("-k", dest="keyword", default=None, metavar="EXPR", help="only cases matching (pytest -k)")
    conf.add_argument(
        "--note", default=None, metavar="TEXT", help="a sentence for the certificate (e.g. why a tier was not run)"
    )
    conf.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    conf.add_argument("--matrix", action="store_true", help="build the support matrix from certificates")
    conf.add_argument("--certs", default="docs/certificates", metavar="DIR", help="certificates for --matrix")
    conf.add_argument("--out", default="docs/support-matrix.md", metavar="FILE", help="output of --matrix")
    conf.add_argument("--pytest-arg", dest="pytest_args", action="append", default=[], help="passed to pytest")
    conf.set_defaults(func=cmd_conformance)

    plugin = sub.add_parser("plugin", help="backend plugin tools")
    psub = plugin.add_subparsers(dest="plugin_command", required=True)
    new = psub.add_parser("new", help="render a new backend plugin package from the template (copier)")
    new.add_argument("name", help="backend name, e.g. acme (package plinth_acme, distribution plinth-acme)")
    new.add_argument("--dest", default=".", help="directory to create the plugin in (default: .)")
    new.add_argument("--template", default=None, help="template path or git URL (default: plinth's own)")
    new.add_argument("--set", action="append", type=_key_value, metavar="KEY=VALUE", help="template answer")
    new.set_defaults(func=cmd_plugin_new)
