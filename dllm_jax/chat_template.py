"""Chat templates as untrusted code: compiled and rendered in jinja2's immutable sandbox, as
transformers does (with its `raise_exception(message)`), and bounded in time (RENDER_SECONDS) and size
(RENDER_CHARS, RENDER_INT_BITS) so that a hostile or broken template ends in a ValueError naming its file
instead of a hang or an exhausted memory. `dllm_jax.tokenizer.ChatTokenizer` reads the files; this
module only compiles and renders.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time

import jinja2
import jinja2.compiler
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from dllm_jax.validation import integer, is_int, real

# A real chat template renders in milliseconds and writes a few kB plus the messages: these bounds only
# stop hostile or broken templates (nested loops that never end, 'x' * 10**10).
RENDER_SECONDS = 5.0  # wall-clock time of one render
RENDER_CHARS = 1 << 26  # characters one render may build and write in all (every value it builds, its
#                         output and its macro/block buffers as they fill), so also the largest single value
RENDER_INT_BITS = 1 << 16  # the largest integer a template may compute (10**10**10 would never finish)
ITEM_CHARS = 64  # what one item of a list, tuple, set or dict counts against RENDER_CHARS: about its memory
#                  in bytes, so a render holds about a million items at most (sorts and walks stay short)
BUDGET = "dllm-jax render budget"  # a render variable no template can name or assign (not an identifier)
BOUNDS = "(RenderLimits.{}, default dllm_jax.chat_template.RENDER_{})"


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    """Bounds on one render of a chat template; a template passing one gets a ValueError naming it."""

    seconds: float = RENDER_SECONDS
    chars: int = RENDER_CHARS

    def __post_init__(self):
        object.__setattr__(self, "seconds", real("RenderLimits.seconds", self.seconds, low=0, low_open=True))
        object.__setattr__(self, "chars", integer("RenderLimits.chars", self.chars))


class TemplateRefused(ValueError):
    """A render stopped by a bound; the message is complete (names the template's file and the bound)."""


class TemplateRaised(jinja2.TemplateError):
    """What a template's `raise_exception(message)` raises (transformers provides the same function)."""


def raise_exception(message):
    raise TemplateRaised(str(message))


class Budget:
    """One render's deadline and the characters it may still build or write (private to that render:
    passed as the BUDGET render variable, so concurrent renders of one template do not share it)."""

    __slots__ = ("deadline", "left")

    def __init__(self, limits: RenderLimits):
        self.deadline = time.monotonic() + limits.seconds
        self.left = limits.chars


class BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Compiles a tick into every loop iteration (the time bound, with the loop's literal text counted
    against the size bound) and a size check around every `~` concatenation."""

    def visit_For(self, node, frame):
        # the tick goes in as template code (a call the sandbox makes through BoundedSandbox.call), so it
        # runs at the start of every iteration whatever the loop's form (filtered, recursive, with else)
        literal = sum(len(data.data) for data in node.find_all(jinja2.nodes.TemplateData))
        tick = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("tick"), [jinja2.nodes.Const(literal)], [],
                                 None, None, lineno=node.lineno)
        node.body = [jinja2.nodes.ExprStmt(tick, lineno=node.lineno), *node.body]
        super().visit_For(node, frame)

    def visit_Concat(self, node, frame):  # jinja's own, less constant folding, through concat_bounded
        self.write("environment.concat_bounded(context, (")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, bounded. Every loop iteration, call, filter and
    intercepted operator checks the render's deadline; `*`, `**`, `%`, calls and filters are refused
    before they would build a value over the size bound (a count, width or join over it); every value
    they build and every piece of output counts against the render's size budget."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = BoundedCodeGenerator

    def __init__(self, where: str, limits: RenderLimits):
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=self.output)
        self.where, self.limits = where, limits
        self.globals["raise_exception"] = raise_exception
        del self.globals["lipsum"]  # random text of any length, in no chat template: one call could pass the bounds
        del self.filters["wordwrap"]  # in no chat template; one call on a long word takes the square of its length
        self.filters = {name: self.bounded_filter(name, function) for name, function in self.filters.items()}

    def metered(self, context, items, cost):
        """`items`, checking the deadline and spending `cost(item)` characters as each is taken: what a
        single call (a join, sum or sort) builds from them stays within the bounds while it runs."""
        for item in items:
            self.spend(context, cost(item))
            yield item

    def refuse(self, what: str):
        raise TemplateRefused(f"{self.where}: the chat template {what}")

    def too_big(self, what: str):
        self.refuse(f"{what} more than {self.limits.chars} characters, the render size bound "
                    + BOUNDS.format("chars", "CHARS"))

    def budget(self, context) -> Budget:
        """The render's budget, after checking its deadline."""
        budget = context.get(BUDGET)
        if not isinstance(budget, Budget):
            self.refuse("was rendered without a budget: render it with ChatTokenizer.render")
        if time.monotonic() > budget.deadline:
            bound = BOUNDS.format("seconds", "SECONDS")
            self.refuse(f"ran past the render time bound of {self.limits.seconds:g} s {bound}")
        return budget

    def spend(self, context, chars: int) -> None:
        budget = self.budget(context)
        budget.left -= chars
        if budget.left < 0:
            self.too_big("built and wrote")

    def checked(self, context, value):
        chars = size(value)
        if chars > self.limits.chars:
            self.too_big("built a value of")
        self.spend(context, chars)
        return value

    @jinja2.pass_context
    def output(self, context, value):
        self.spend(context, size(value))
        return value

    @jinja2.pass_context
    def tick(self, context, literal: int) -> str:
        self.spend(context, literal)
        return ""

    def concat_bounded(self, context, parts: tuple) -> str:
        """`a ~ b ~ ...` (jinja's str_join; these templates are not autoescaped), sized before the join:
        a part may be a list literal holding one long string many times."""
        self.check_estimate(sum(size(part) for part in parts))
        return self.checked(context, "".join(map(str, parts)))

    def check_estimate(self, chars: int) -> None:
        if chars > self.limits.chars:
            self.too_big("would build a value of")

    def check_arguments(self, values) -> None:
        """Refuses, before a call, arguments that would let it build a value far over the bound: a count
        or width over it ('x'.center(10**10)), or sequences whose total passes it (a join)."""
        for value in values:
            if is_int(value) and abs(value) > self.limits.chars:
                self.too_big(f"takes an argument of {value}, a count or width of")
        self.check_estimate(sum(size(value) for value in values))

    def call_binop(self, context, operator, left, right):
        self.budget(context)
        if operator == "*":
            self.check_product(left, right)
        elif operator == "**" and is_int(left) and is_int(right) and right > 0 and \
                max(abs(left).bit_length() - 1, 1) * right > RENDER_INT_BITS:
            self.refuse_int()
        elif operator == "%" and isinstance(left, str):
            self.check_estimate(format_size(left, right, self.limits.chars))
        return self.checked(context, super().call_binop(context, operator, left, right))

    def refuse_int(self):
        self.refuse(f"computes an integer of more than {RENDER_INT_BITS} bits (dllm_jax.tokenizer.RENDER_INT_BITS)")

    def check_product(self, left, right) -> None:
        if is_int(left) and is_int(right):
            if abs(left).bit_length() + abs(right).bit_length() > RENDER_INT_BITS:
                self.refuse_int()
        elif is_int(left) or is_int(right):
            count, sequence = (right, left) if is_int(right) else (left, right)
            self.check_estimate(size(sequence) * max(int(count), 0))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's own signature)
        __self.budget(__context)
        __self.check_arguments([*args, *kwargs.values()])
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format / format_map
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            name = getattr(method, "__name__", "")
            if name in ("format", "format_map"):
                __self.check_estimate(format_size(owner, [*args, *kwargs.values()], __self.limits.chars))
            elif name == "replace" and len(args) >= 2:
                __self.check_estimate(replaced_size(owner, *args[:2]))
            elif name == "expandtabs":
                width = args[0] if args else kwargs.get("tabsize", 8)
                __self.check_estimate(len(owner) + owner.count("\t") * (int(width) if is_int(width) else 0))
            elif name == "translate" and args and isinstance(args[0], dict):
                __self.check_estimate(len(owner) * max([size(value) for value in args[0].values()] + [1]))
            elif name == "join" and args:  # the separator between every two items: sized as they are taken
                args = (__self.metered(__context, args[0], lambda item: len(owner) + size(item)), *args[1:])
        return __self.checked(__context, super().call(__context, __obj, *args, **kwargs))

    def bounded_filter(self, name: str, function):
        """`function` with its arguments checked before and its value after. The wrapper takes the
        context (for the render's budget) and hands the filter what its own pass_* marker asks for."""
        wants = getattr(getattr(function, "jinja_pass_arg", None), "name", None)

        @functools.wraps(function)
        def bounded(context, *args, **kwargs):
            self.budget(context)
            self.check_arguments([*args, *kwargs.values()])
            if args:
                self.check_estimate(filter_size(name, args[0], args[1:], kwargs, self.limits.chars))
                if name in ITERATING and args[0]:  # empty or undefined: as jinja has it (map, select test it)
                    args = (self.metered(context, args[0], item_cost(name, args[1:], kwargs)), *args[1:])
            lead = {"context": (context,), "eval_context": (context.eval_ctx,), "environment": (self,)}.get(wants, ())
            return self.checked(context, function(*lead, *args, **kwargs))

        return jinja2.pass_context(bounded)


# the filters that take their input item by item (strings by character): they get it metered
ITERATING = frozenset({"batch", "groupby", "join", "list", "map", "max", "min", "reject", "rejectattr", "select",
                       "selectattr", "slice", "sort", "sum", "unique"})


def item_cost(name: str, args: tuple, kwargs: dict):
    """What each item a filter takes counts against the size bound: a join copies it and its separator; a
    sum of strings, lists or tuples copies the running total at every step; the others take a reference
    (ITEM_CHARS; what they return is sized whole after the call)."""
    if name == "join":
        separator = size(args[0] if args else kwargs.get("d", ""))
        return lambda item: size(item) + separator
    if name == "sum":  # do_sum(iterable, attribute=None, start=0)
        total = size(args[1] if len(args) > 1 else kwargs.get("start", 0))

        def running(item) -> int:
            nonlocal total
            total += size(item)
            return total if isinstance(item, (str, list, tuple)) else size(item)

        return running
    return lambda item: ITEM_CHARS


def size(value, depth: int = 0) -> int:
    """About how many characters `value` takes as text or memory: strings by length, integers by digits,
    containers (and a namespace's values) by their contents and ITEM_CHARS an item, anything else as a
    short repr."""
    if isinstance(value, str):
        return len(value)
    if is_int(value):
        return int(abs(value)).bit_length() // 3 + 2
    if depth > 64:  # refused rather than walked further (a namespace that holds itself never ends)
        return 1 << 62
    if isinstance(value, dict):
        return sum(size(k, depth + 1) + size(v, depth + 1) + ITEM_CHARS for k, v in value.items()) + 2
    if isinstance(value, (list, tuple, set, frozenset)):
        return sum(size(item, depth + 1) + ITEM_CHARS for item in value) + 2
    if isinstance(value, jinja2.utils.Namespace):
        return size(object.__getattribute__(value, "__dict__"), depth + 1)
    return 64


def replaced_size(text: str, old, new) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    return len(text) + text.count(old) * max(len(new) - len(old), 0)


def format_size(template: str, arguments, bound: int) -> int:
    """An upper estimate of a printf- or str.format-style result: every field may hold every argument,
    and every number in the template may be a width."""
    fields = template.count("%") + template.count("{")
    widths = sum(int(run) if len(run) < 10 else bound + 1 for run in re.findall(r"\d+", template))
    arguments = list(arguments.values()) if isinstance(arguments, dict) else arguments
    return len(template) + widths + fields * size(arguments)


def filter_size(name: str, value, args: tuple, kwargs: dict, bound: int) -> int:
    """An upper estimate of what the filters that can multiply their input would build of `value`."""
    if name == "tojson":  # every item on its own line, indented up to its depth
        indent = args[0] if args else kwargs.get("indent")
        return (size(value) + 1) * (1 + (max(int(indent), 0) if is_int(indent) else 0))
    if not isinstance(value, str):
        return 0
    if name == "replace" and len(args) >= 2:
        return replaced_size(value, *args[:2])
    if name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        per_line = len(width) if isinstance(width, str) else max(int(width), 0) if is_int(width) else 0
        return len(value) + (value.count("\n") + 1) * per_line
    if name == "format":
        return format_size(value, [*args, *kwargs.values()], bound)
    return len(value)


def describe(error: Exception) -> str:
    if isinstance(error, TemplateRaised):
        return f"it raised {error.message!r}"
    if isinstance(error, jinja2.sandbox.SecurityError):
        return f"blocked by the sandbox ({error})"
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:300] + "..."


def compile_template(source: str, where: str, limits: RenderLimits) -> jinja2.Template:
    try:
        return BoundedSandbox(where, limits).from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where}: chat template syntax error at line {e.lineno}: {e.message}") from None
    except Exception as e:  # the parser, code generator and Python's compiler each refuse some sources
        raise ValueError(f"{where}: the chat template does not compile: {describe(e)}") from None


def render(template: jinja2.Template, where: str, variables: dict) -> str:
    """The template rendered with `variables` under its environment's bounds; ValueError naming `where`
    (the template's file) for a bound passed or anything the template's code raises."""
    try:
        return template.render({BUDGET: Budget(template.environment.limits), **variables})
    except TemplateRefused:
        raise
    except Exception as e:  # anything a template's code raises is that template's problem, named as such
        raise ValueError(f"{where}: the chat template failed: {describe(e)}") from e
