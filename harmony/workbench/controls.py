"""The explorers' common ground: controls -> ``compute()`` -> ``chart()`` shown
in an output (:class:`Explorer`), and the controls of one plan, turned into a
:class:`~harmony.plan.Plan` by :meth:`Plan.uniform` (:class:`PlanExplorer`).

Needs the ``notebooks`` extra (ipywidgets)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

from ..plan import Plan
from ..policies import get_policy, names
from .comparison import policy_of
from .display import live_bundle, loader_bundle

try:
    import ipywidgets as w
except ImportError:  # pragma: no cover - depends on the install
    raise ImportError(
        "harmony.workbench's explorers need ipywidgets: pip install -e '.[notebooks]'"
    ) from None

STYLE = {"description_width": "130px"}


def int_text(value: int, description: str, top: int) -> w.BoundedIntText:
    return w.BoundedIntText(value=value, min=1, max=top, description=description, style=STYLE)


def slider(value: int, description: str, top: int, bottom: int = 1) -> w.IntSlider:
    """An integer slider that reports only where it is let go (a redraw costs a simulation)."""
    return w.IntSlider(
        value=value,
        min=bottom,
        max=max(value, top),
        description=description,
        continuous_update=False,
        style=STYLE,
    )


def shown(bundle: dict) -> dict:
    """One output of an ``Output`` widget, showing the mime ``bundle``."""
    return {"output_type": "display_data", "data": bundle, "metadata": {}}


def html_bundle(text: str) -> dict:
    return {"text/html": text, "text/plain": ""}


class Explorer:
    """Controls -> ``compute()`` -> ``chart()``, shown in ``self.output``.

    A change is drawn in one step: the new output is built off-screen, then
    replaces the old one at once. Explorers whose :meth:`state` says what the
    controls are keep the outputs of the last :data:`KEPT` settings, so going
    back to one shows it again without computing it."""

    #: how many settings' outputs an explorer keeps
    KEPT = 16
    output: w.Output
    result = None
    _box: w.Widget | None = None
    _holding = False
    _views: OrderedDict | None = None

    def controls(self) -> list[w.Widget]:
        raise NotImplementedError

    def compute(self):
        raise NotImplementedError

    def chart(self, result=None):
        raise NotImplementedError

    def actions(self) -> list[w.Widget]:
        """Buttons shown under the controls (none unless an explorer has some)."""
        return []

    def state(self) -> tuple | None:
        """Everything the output depends on, or None: not kept."""
        return None

    def shown(self) -> None:
        """Called once an update is on its way to the page (nothing unless an
        explorer prepares for the next one)."""

    def view(self, result) -> list[dict]:
        """What the output shows of ``result``, as mime bundles: the chart with the
        table under it (one bundle: they appear together, once the chart is drawn)."""
        return [live_bundle(self.chart(result), below=result.table().to_html())]

    def _wire(self) -> None:
        """Connect the controls to :meth:`render` (once, when first shown)."""
        raise NotImplementedError

    def render(self) -> None:
        """Compute and replace what ``self.output`` shows: the chart and the table."""
        if self._holding:
            return
        key = self.state()
        views = self._views = self._views if self._views is not None else OrderedDict()
        if key is not None and key in views:
            views.move_to_end(key)
            self.result, outputs = views[key]
        else:
            result = self.compute()
            outputs = tuple(shown(bundle) for bundle in self.view(result))
            if key is not None:
                views[key] = (result, outputs)
                while len(views) > self.KEPT:
                    views.popitem(last=False)
        self.output.outputs = outputs  # one step: the old output goes as the new one comes
        self.shown()

    def set(self, **values) -> None:
        """Set several controls (by attribute name, in the order given), then
        draw once if the widget is shown, not once per control."""
        with self._held():
            for name, value in values.items():
                getattr(self, name).value = value
        if self._box is not None:
            self.render()

    @contextlib.contextmanager
    def _held(self):
        """No drawing inside (nested holds keep the outer one)."""
        before, self._holding = self._holding, True
        try:
            yield
        finally:
            self._holding = before

    def widget(self) -> w.Widget:
        """The controls in a grid over the live output (for JupyterLab)."""
        if self._box is None:
            grid = w.GridBox(
                self.controls(), layout=w.Layout(grid_template_columns="repeat(3, 330px)")
            )
            buttons = [w.HBox(self.actions())] if self.actions() else []
            # vega's script, once for every chart the output will show
            loader = w.Output(layout=w.Layout(height="0px", overflow="hidden"))
            loader.outputs = (shown(loader_bundle()),)
            self._box = w.VBox([grid, *buttons, self.output, loader])
            self._wire()
        return self._box

    def _repr_mimebundle_(self, **kwargs):
        return self.widget()._repr_mimebundle_(**kwargs)


class PlanExplorer(Explorer):
    """An explorer of one plan: a policy, the minibatch, forward and backward
    microbatch sizes, layers per pack and the options a user sets most."""

    def _plan_controls(
        self,
        policy: str,
        minibatch: int,
        fwd_microbatch: int,
        bwd_microbatch: int,
        pack_size: int,
        offload_activations: bool,
        prefetch_packs: int,
        top: int,
        most_layers: int,
        policies: list[str] | None = None,
    ) -> None:
        """Make the plan's controls; sizes up to ``top``, packs up to ``most_layers``
        layers, the ``policies`` offered (default: every policy's name)."""
        self.policy = w.Dropdown(
            options=policies or names(), value=policy, description="policy", style=STYLE
        )
        self.minibatch = int_text(minibatch, "minibatch", top)
        self.fwd_microbatch = int_text(fwd_microbatch, "fwd microbatch", top)
        self.bwd_microbatch = int_text(bwd_microbatch, "bwd microbatch", top)
        self.pack_size = slider(pack_size, "layers per pack", most_layers)
        self.offload_activations = w.Checkbox(
            value=offload_activations, description="offload activations"
        )
        self.prefetch_packs = slider(prefetch_packs, "prefetch packs", 3)
        self.policy.observe(self._policy_changed, "value")
        self._policy_changed()

    def plan_controls(self) -> list[w.Widget]:
        return [
            self.policy,
            self.minibatch,
            self.fwd_microbatch,
            self.bwd_microbatch,
            self.pack_size,
            self.offload_activations,
            self.prefetch_packs,
        ]

    def _policy_changed(self, _=None) -> None:
        policy, _ = policy_of(self.policy.value)
        one_size = get_policy(policy).PER_MICROBATCH
        self.fwd_microbatch.disabled = one_size
        self.fwd_microbatch.tooltip = (
            f"{policy} uses the bwd microbatch for both" if one_size else ""
        )

    def plan_for(self, policy: str, n_gpus: int, num_layers: int, **sizes: int) -> Plan:
        """The controls' plan under ``policy``: :meth:`Plan.uniform` packs (its
        remainder rule), one microbatch size for a policy that runs each
        microbatch forward then backward (the backward one). ``sizes`` (any of
        ``pack_size``, ``fwd_microbatch``, ``bwd_microbatch``) stand in for
        those controls' values."""
        ub = sizes.get("bwd_microbatch", self.bwd_microbatch.value)
        uf = sizes.get("fwd_microbatch", self.fwd_microbatch.value)
        return Plan.uniform(
            policy,
            n_gpus,
            self.minibatch.value,
            ub,
            num_layers,
            sizes.get("pack_size", self.pack_size.value),
            fwd_microbatch=ub if get_policy(policy).PER_MICROBATCH else uf,
            offload_activations=self.offload_activations.value,
            prefetch_packs=self.prefetch_packs.value,
        )

    def steps(self) -> list[dict[str, int]]:
        """The plan's sizes one step from the controls' (a layer per pack more or
        less, each microbatch size doubled or halved, within its control's range
        and the minibatch): the settings a reader is likely to try next."""
        top = {"pack_size": self.pack_size.max}  # the microbatches: the minibatch
        steps = []
        for name, moves in (
            ("pack_size", (lambda v: v + 1, lambda v: v - 1)),
            ("bwd_microbatch", (lambda v: v // 2, lambda v: v * 2)),
            ("fwd_microbatch", (lambda v: v // 2, lambda v: v * 2)),
        ):
            control = getattr(self, name)
            if control.disabled:
                continue
            for move in moves:
                value = move(control.value)
                if 1 <= value <= top.get(name, self.minibatch.value):
                    steps.append({name: value})
        return steps
