"""Constraints of constrained beam search, as the seeds define them (transformers 4.x
``generation.beam_constraints``; transformers 5.x dropped them from its core):

- ``PhrasalConstraint(token_ids)``: the output must contain this sequence of tokens;
- ``DisjunctiveConstraint(nested_token_ids)``: it must contain one of these sequences (none a prefix of
  another);
- ``ConstraintListState``: how far a sequence has come through a list of constraints: those complete, the one
  in progress, those pending; its ``bank`` (how many constraint tokens are fulfilled, counting a complete
  constraint as the longest one's length) ranks beams; ``advance()`` names the tokens that make progress.

A constraint in progress that the next token does not continue starts over (pending again).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Constraint(ABC):
    """One constraint's progress; ``update(token)`` returns (stepped, completed, reset)."""

    seqlen: int
    completed: bool = False

    @abstractmethod
    def advance(self) -> list[int]:
        """The tokens that would make progress (none once complete)."""

    def does_advance(self, token_id: int) -> bool:
        return token_id in self.advance()

    @abstractmethod
    def update(self, token_id: int) -> tuple[bool, bool, bool]: ...

    @abstractmethod
    def remaining(self) -> int:
        """Tokens still needed to complete it."""

    @abstractmethod
    def copy(self, stateful: bool = False) -> Constraint: ...


class PhrasalConstraint(Constraint):
    """The output must contain ``token_ids``, in order and contiguous."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        if not token_ids or not all(isinstance(t, int) and t >= 0 for t in token_ids):
            raise ValueError(f"a phrasal constraint is a non-empty list of token ids, got {token_ids!r}")
        self.token_ids = list(token_ids)
        self.seqlen = len(self.token_ids)
        self.fulfilled = 0  # tokens of the phrase matched so far
        self.completed = False

    def advance(self) -> list[int]:
        return [] if self.completed else [self.token_ids[self.fulfilled]]

    def update(self, token_id: int) -> tuple[bool, bool, bool]:
        if not self.does_advance(token_id):
            self.fulfilled, self.completed = 0, False
            return False, False, True
        self.fulfilled += 1
        self.completed = self.fulfilled == self.seqlen
        return True, self.completed, False

    def remaining(self) -> int:
        return self.seqlen - self.fulfilled

    def copy(self, stateful: bool = False) -> PhrasalConstraint:
        new = PhrasalConstraint(self.token_ids)
        if stateful:
            new.fulfilled, new.completed = self.fulfilled, self.completed
        return new


class DisjunctiveConstraint(Constraint):
    """The output must contain one of ``nested_token_ids`` (a trie of them: none may be a prefix of
    another)."""

    def __init__(self, nested_token_ids: Sequence[Sequence[int]]) -> None:
        words = [list(w) for w in nested_token_ids]
        if not words or not all(w and all(isinstance(t, int) and t >= 0 for t in w) for w in words):
            raise ValueError(
                f"a disjunctive constraint is a list of token id lists, got {nested_token_ids!r}"
            )
        self.token_ids = words
        self.trie: dict[int, dict] = {}
        for word in words:
            level = self.trie
            for token in word:
                level = level.setdefault(token, {})
        if _count_leaves(self.trie) != len(words):
            raise ValueError(f"a word of a disjunctive constraint is a prefix of another: {words!r}")
        self.seqlen = max(len(w) for w in words)
        self.current: list[int] = []
        self.completed = False

    def advance(self) -> list[int]:
        level = self.trie
        for token in self.current:
            level = level[token]
        return list(level)

    def update(self, token_id: int) -> tuple[bool, bool, bool]:
        stepped = self.does_advance(token_id)
        self.current = [*self.current, token_id] if stepped else []
        self.completed = stepped and not self.advance()
        return stepped, self.completed, not stepped

    def remaining(self) -> int:
        return 0 if self.completed else self.seqlen - len(self.current)

    def copy(self, stateful: bool = False) -> DisjunctiveConstraint:
        new = DisjunctiveConstraint(self.token_ids)
        if stateful:
            new.current, new.completed = list(self.current), self.completed
        return new


def _count_leaves(level: dict[int, dict]) -> int:
    return 1 if not level else sum(_count_leaves(child) for child in level.values())


class ConstraintListState:
    """A sequence's progress through ``constraints`` (which are only copied, never changed)."""

    def __init__(self, constraints: Sequence[Constraint]) -> None:
        self.constraints = list(constraints)
        self.max_seqlen = max(c.seqlen for c in self.constraints)
        self.complete: list[Constraint] = []
        self.inprogress: Constraint | None = None
        self.pending = [c.copy() for c in self.constraints]
        self.completed = False

    @classmethod
    def of(cls, constraints: Sequence[Constraint], token_ids: Sequence[int]) -> ConstraintListState:
        """The state after ``token_ids``."""
        state = cls(constraints)
        for token in token_ids:
            state.add(token)
            if state.completed:
                break
        return state

    @property
    def bank(self) -> int:
        progress = self.max_seqlen - self.inprogress.remaining() if self.inprogress is not None else 0
        return len(self.complete) * self.max_seqlen + progress

    def advance(self) -> list[int]:
        """The tokens that make progress: the constraint in progress continued, else any pending one begun."""
        if self.inprogress is not None:
            return self.inprogress.advance()
        return [t for c in self.pending for t in c.advance()]

    def add(self, token_id: int) -> None:
        if self.completed:
            return
        if self.inprogress is not None:
            _, complete, reset = self.inprogress.update(token_id)
            if reset:
                self.pending.append(self.inprogress.copy())
                self.inprogress = None
            elif complete:
                self.complete.append(self.inprogress)
                self.inprogress = None
                self.completed = not self.pending
            return
        for i, constraint in enumerate(self.pending):
            if constraint.does_advance(token_id):
                _, complete, _ = constraint.update(token_id)
                if complete:
                    self.complete.append(constraint)
                else:
                    self.inprogress = constraint
                del self.pending[i]
                self.completed = not self.pending and self.inprogress is None
                return

    def copy(self) -> ConstraintListState:
        new = ConstraintListState(self.constraints)
        new.complete = [c.copy(stateful=True) for c in self.complete]
        new.inprogress = self.inprogress.copy(stateful=True) if self.inprogress is not None else None
        new.pending = [c.copy() for c in self.pending]
        new.completed = self.completed
        return new


def constraints_of(force_words_ids: Sequence[Sequence[int] | Sequence[Sequence[int]]]) -> list[Constraint]:
    """transformers' ``force_words_ids``: a list of token ids is a phrasal constraint, a list of such lists a
    disjunctive one. Raises ``ValueError``."""
    out: list[Constraint] = []
    for word in force_words_ids:
        if isinstance(word, (list, tuple)) and word and isinstance(word[0], (list, tuple)):
            out.append(DisjunctiveConstraint(word))  # type: ignore[arg-type]
        else:
            out.append(PhrasalConstraint(word))  # type: ignore[arg-type]
    if not out:
        raise ValueError("force_words_ids must hold at least one word")
    return out
