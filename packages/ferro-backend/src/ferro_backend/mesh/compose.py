"""What the layers built on a socket transport compose with (:class:`Composable`, a mixin of
:class:`~ferro_backend.TcpBackend`): its mailbox, the routes that carry some peers' messages
instead of the sockets (the same-host engine's rings), and callbacks on failure and on close."""

from __future__ import annotations

from collections.abc import Callable

from ..mailbox import Mailbox
from .route import Route


class Composable:
    """The composition half of a socket transport; the transport sets ``_box`` (its
    :class:`~ferro_backend.mailbox.Mailbox`), ``_route_list``, ``_routes`` (peer -> route) and
    ``_closers``, and provides ``rank``."""

    _box: Mailbox
    _route_list: list[Route]
    _routes: dict[int, Route]
    _closers: list[Callable[[], None]]
    rank: int

    @property
    def mailbox(self) -> Mailbox:
        """This rank's receive side (posted receives, queued messages, known failures): routes
        deliver into it, and every failure the mesh learns of is recorded there."""
        return self._box

    def install_route(self, route: Route) -> None:
        """Send to and receive from ``route.peers`` through ``route`` instead of the sockets
        (the same-host engine's rings: ``ferro_backend.engine``); the route is closed with
        this backend. Install routes before any message to those peers (at set-up).

        Parameters
        ----------
        route : ferro_backend.mesh.route.Route
            Carries the messages of its ``peers``.

        Raises
        ------
        ValueError
            A peer of ``route`` already has a route, or is this rank (names them).
        """
        taken = sorted(set(route.peers) & set(self._routes))
        if taken or self.rank in route.peers:
            raise ValueError(f"install_route: peers {taken or [self.rank]} already have a route "
                             "(or are this rank)")
        self._route_list.append(route)
        self._routes.update(dict.fromkeys(route.peers, route))

    def routes(self) -> list[Route]:
        """The routes installed on this backend.

        Returns
        -------
        list of ferro_backend.mesh.route.Route
            In the order they were installed.
        """
        return list(self._route_list)

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on every failure this rank learns of (a peer gone, an abort,
        this backend closing), from the thread that saw it; at once if one happened already.

        Parameters
        ----------
        callback : callable
            Called with no arguments.
        """
        self._box.add_failure_callback(callback)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when this backend tears down (after its mailbox is closed).

        Parameters
        ----------
        callback : callable
            Called with no arguments (e.g. an engine's segment release).
        """
        self._closers.append(callback)
