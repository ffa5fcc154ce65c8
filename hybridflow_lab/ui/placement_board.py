"""``placement_board(lab)``: place the models on device pools and pick their parallel sizes (the actor's training
and generation TP, and its training's pipeline stages).

Only valid values are offered (each choice is checked with the config validation); an invalid
combination says why; Apply reconfigures the Lab (restarting running worker groups). A ``suggest``
function (the auto-mapping search) can fill the ranked suggestions slot.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import plotly.graph_objects as go

from hybridflow_lab.config import TRAIN_BACKENDS, LabConfig
from hybridflow_lab.dataflows.preflight import model_summary
from hybridflow_lab.placement import Placement, Suggestion
from hybridflow_lab.placement.hardware import machine_profile
from hybridflow_lab.placement.measured import stage_seconds
from hybridflow_lab.placement.predict import predict
from hybridflow_lab.placement.suggest import overlaps
from hybridflow_lab.placement.workload import workload_from_config
from hybridflow_lab.ui.live_figure import LiveFigure
from hybridflow_lab.ui.plan_figure import predicted_beside_measured
from hybridflow_lab.ui.theme import themed

if TYPE_CHECKING:
    from hybridflow_lab.trainer.lab import Lab

Suggester = Callable[[LabConfig, int], list[Suggestion]]
ROLE_COLORS = {"actor": "#4c78a8", "critic": "#f58518"}
ROLE_NOTES = {"actor": "actor + rollout + reference", "critic": "critic"}


def device_grid_html(plan: Placement, devices: int) -> str:
    """One box per device slot: its pool and the roles whose ranks run there; free slots greyed."""
    boxes = []
    for slot, (pool, roles) in enumerate(plan.device_map()):
        chips = "".join(f"<div style='background:{ROLE_COLORS.get(r, '#888')};color:white;border-radius:3px;"
                        f"margin:2px;padding:0 4px'>{html.escape(r)}</div>" for r in roles)
        boxes.append(f"<div class='slot' title='slot {slot}' style='border:1px solid #999;padding:4px;min-width:90px'>"
                     f"<small>slot {slot} · {html.escape(pool)}</small>{chips}</div>")
    boxes += [f"<div class='slot free' style='border:1px dashed #ccc;padding:4px;min-width:90px;color:#aaa'>"
              f"<small>slot {slot} · free</small></div>" for slot in range(len(boxes), devices)]
    return f"<div class='hybridflow-devices' style='display:flex;flex-wrap:wrap;gap:4px'>{''.join(boxes)}</div>"


def default_devices(plan: Placement) -> int:
    """GPUs in the Ray cluster when there are some; otherwise 8 logical CPU slots (at least what the plan uses)."""
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0
    return max(gpus or 8, plan.devices_needed())


class PlacementBoard:
    """Widgets editing ``lab``'s placement: pool per model, pool sizes, the actor's TP sizes and pipeline stages,
    training engines."""

    def __init__(self, lab: Lab, devices: int | None = None, suggest: Suggester | None = None) -> None:
        self.lab = lab
        self.plan = Placement.from_config(lab.config)
        self.devices = devices or default_devices(self.plan)
        self.suggest = suggest
        self.applied: list[list[str]] = []  # the overrides of every Apply, oldest first
        self.grid = widgets.HTML()
        self.controls = widgets.VBox()
        self.status = widgets.HTML()
        self.apply_button = widgets.Button(description="Apply", button_style="primary", icon="check")
        self.apply_button.on_click(lambda _: self.apply())
        self.suggest_button = widgets.Button(description="Suggest", icon="magic", disabled=suggest is None,
                                             tooltip="rank placements with the auto-mapping search")
        self.suggest_button.on_click(lambda _: self.show_suggestions(self.suggest(lab.config, self.devices)))
        self.suggestions = widgets.VBox([widgets.HTML("<i>no suggestions yet</i>")])
        self.timing = LiveFigure()
        self.header = widgets.HTML(f"<b>Placement</b> of {html.escape(lab.name)} on {self.devices} device slots; "
                                   f"model: {html.escape(model_summary(lab.config))}")
        self.widget = themed(widgets.VBox([
            self.header, self.grid,
            self.controls, widgets.HBox([self.apply_button, self.suggest_button]), self.status, self.timing,
            widgets.HTML("<b>Suggestions</b>"), self.suggestions,
        ]))
        self._unsubscribe = lab.subscribe_steps(lambda _: self._draw_timing())
        self._render()

    # ------------------------------------------------------------ editing
    def set_plan(self, plan: Placement) -> None:
        self.plan = plan
        self._render()

    def _render(self) -> None:
        config = self.lab.config
        rows: list[widgets.Widget] = []
        for role in self.plan.engines:  # the trained roles; the reference and reward model follow the actor
            rows.append(self._role_row(role, self.plan.assignment[role]))
        for pool in self.plan.used_pools():
            sizes = self.plan.pool_size_choices(config, self.devices, pool) or [self.plan.pools[pool]]
            rows.append(self._choice(f"pool {pool} slots", sizes, self.plan.pools[pool],
                                     lambda size, pool=pool: self.plan.with_changes(pools={**self.plan.pools,
                                                                                           pool: size})))
        for which, label in (("t", "training TP"), ("tg", "generation TP")):
            current = getattr(self.plan.size_of("actor"), which)
            sizes = self.plan.tensor_parallel_choices(config, self.devices, which) or [current]
            rows.append(self._choice(label, sizes, current, lambda tp, which=which: self.plan.with_actor_tp(which, tp)))
        stages = self.plan.size_of("actor").p
        rows.append(self._choice("pipeline stages", self.plan.pipeline_choices(config, self.devices) or [stages],
                                 stages, lambda p: self.plan.with_actor_pipeline(p)))
        self.controls.children = rows
        self.grid.value = device_grid_html(self.plan, self.devices)
        problem = self.plan.problem(config, self.devices)
        self.apply_button.disabled = problem is not None
        self._draw_timing(problem)
        self.status.value = (f"<span style='color:#b00'>cannot run: {html.escape(problem)}</span>" if problem else
                             f"valid: {self.plan.devices_needed()} of {self.devices} slots "
                             f"({html.escape(self.plan.pool_summary())})")

    def _draw_timing(self, problem: str | None = None) -> None:
        """The simulator's stages for the board's plan (on this machine's profile) beside the Lab's last step."""
        config = self.lab.config
        if problem is not None:
            self.timing.show(go.Figure(layout={"title": "no prediction: the plan cannot run", "height": 120}))
            return
        placed = self.plan.apply(config)
        prediction = predict(self.plan, workload_from_config(placed), machine_profile(self.plan.devices_needed()),
                             concurrent=overlaps(placed))
        measured = stage_seconds(self.lab.history[-1:]) if self.lab.history else None
        self.timing.show(predicted_beside_measured(prediction, measured))

    def close(self) -> None:
        """Stop following the Lab's steps and close the widgets."""
        self._unsubscribe()
        self.widget.close()

    def _role_row(self, role: str, pool: str) -> widgets.Widget:
        pools = sorted({*self.plan.pools, "main", role})
        pool_menu = widgets.Dropdown(options=pools, value=pool, description="pool", layout={"width": "180px"})
        pool_menu.observe(lambda change: self._move(role, change["new"]), names="value")
        engine = widgets.Dropdown(options=TRAIN_BACKENDS, value=self.plan.engines[role], description="engine",
                                  layout={"width": "200px"})
        engine.observe(lambda change: self.set_plan(self.plan.with_changes(
            engines={**self.plan.engines, role: change["new"]})), names="value")
        zero = widgets.Dropdown(options=[1, 2, 3], value=self.plan.zero_stages[role], description="ZeRO",
                                disabled=self.plan.engines[role] != "deepspeed", layout={"width": "140px"})
        zero.observe(lambda change: self.set_plan(self.plan.with_changes(
            zero_stages={**self.plan.zero_stages, role: change["new"]})), names="value")
        label = widgets.HTML(f"<b style='color:{ROLE_COLORS.get(role, '#333')}'>{html.escape(ROLE_NOTES[role])}</b>",
                             layout={"width": "200px"})
        return widgets.HBox([label, pool_menu, engine, zero])

    def _move(self, role: str, pool: str) -> None:
        """Put ``role`` on ``pool`` (``Placement.moved``)."""
        self.set_plan(self.plan.moved(role, pool))

    def _choice(self, label: str, options: list[int], value: int,
                to_plan: Callable[[int], Placement]) -> widgets.Widget:
        buttons = widgets.ToggleButtons(options=options, value=value if value in options else options[0],
                                        description=label, style={"description_width": "140px", "button_width": "40px"})
        buttons.observe(lambda change: self.set_plan(to_plan(change["new"])), names="value")
        return buttons

    # ------------------------------------------------------------ actions
    def apply(self) -> None:
        """Reconfigure the Lab with the plan (running worker groups restart with the new layout)."""
        overrides = self.plan.overrides()
        running = bool(self.lab.groups)
        self.status.value = "restarting worker groups..." if running else "applying..."
        try:
            done = self.lab.reconfigure(*overrides)
        except Exception as error:  # shown on the board; the Lab keeps its previous config
            self.status.value = f"<span style='color:#b00'>not applied: {html.escape(str(error))}</span>"
            raise
        self.applied.append(overrides)
        self.plan = Placement.from_config(self.lab.config)
        self._render()
        restarted = " and restarted the worker groups" if done.restarted else ""
        carried = f"<br><small>{html.escape(str(done))}</small>" if done.restarted else ""
        self.status.value = f"applied{restarted}: {html.escape(self.plan.pool_summary())}{carried}"

    def show_suggestions(self, suggestions: list[Suggestion]) -> None:
        """List ranked suggestions; clicking one loads its plan into the board (Apply still applies it)."""
        buttons = []
        for rank, suggestion in enumerate(suggestions, 1):
            button = widgets.Button(description=f"{rank}. {suggestion.label} (~{suggestion.estimated_step_s:.2f} s)",
                                    layout={"width": "auto"})
            button.on_click(lambda _, plan=suggestion.plan: self.set_plan(plan))
            buttons.append(button)
        self.suggestions.children = buttons or [widgets.HTML("<i>no suggestion fits</i>")]

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def placement_board(lab: Lab, **options: Any) -> PlacementBoard:
    """Widgets to place ``lab``'s models on device pools and set their parallel sizes; its Suggest button ranks
    placements with the auto-mapping search (``placement.suggest``) unless ``options`` give another."""
    from hybridflow_lab.placement.suggest import suggest

    return PlacementBoard(lab, **{"suggest": suggest, **options})
