"""A rank's lines made whole again on the launcher, before the console reads them (console.py).

What reaches the launcher is not always one rank's line per line: mpirun cuts a long line into
4 KB pieces (joined) and Open MPI 4 tags each chunk a rank writes, not each line (untangled); a
rank killed mid-print leaves its last line without a newline for the next one to run on after
(untangled); a heartbeat can land inside a progress bar's line (Spliced); and a bar's redraws
come as one line of "\r"-separated pieces (settled). Each function takes a line as it came and
gives back the lines the ranks wrote. The tags are hvdhetero/progress.py's.
"""

from __future__ import annotations

import json
import re
from typing import Iterable, Iterator

from hvdhetero.progress import ALIVE_TAG, ERROR_TAG, PREFIX, RESULT_TAG, TAG, TAG_MARK


def without_heartbeat(body: str) -> tuple[str, dict | None]:
    """A line's text without the heartbeat in it (one flat JSON object after ALIVE_TAG, maybe
    written between another line's text and its newline), and the heartbeat (None if garbled)."""
    text, _, beat = body.partition(ALIVE_TAG)
    try:
        parsed = json.loads(beat.split("}", 1)[0] + "}")
        parsed = parsed if {"rank", "host"} <= set(parsed) else None
    except ValueError:
        parsed = None
    return (text + "\n" if text else ""), parsed


MAX_PIECES = 256
"""The most pieces (4 KB each) a line cut by mpirun is joined from (1 MB: a result line's history)."""
CUT_AT = 4000
"""A tagged line cut short this long or longer may go on in pieces (mpirun's reads are 4 KB); a
shorter one was cut by its rank's end."""


def joined(lines: Iterable[str]) -> Iterator[str]:
    """`lines` with each of our tagged lines whole: mpirun cuts a rank's line longer than its read
    (4 KB: a 150-epoch run's result line, with every epoch's figures) into pieces, the later ones
    on lines of their own without the rank's prefix, which the console showed as raw JSON. A
    tagged line whose JSON is cut short is held and joined with the unprefixed lines after it
    until it is whole; the ranks' prefixed lines pass meanwhile (a heartbeat on the other stream).
    One never whole goes on as it came (a rank killed mid-write: left out, as before)."""
    held, pieces = None, 0
    for line in lines:
        piece = held is not None and PREFIX.match(line) is None
        if piece and pieces < MAX_PIECES:
            held, pieces = held.rstrip("\r\n") + line, pieces + 1
            if _whole(held):
                yield held
                held = None
            continue
        if piece:  # too many pieces: give up on it
            yield held
            held = None
        if held is None and len(line) >= CUT_AT and not _whole(line):
            held, pieces = line, 0
            continue
        yield line
    if held is not None:
        yield held


def _whole(line: str) -> bool:
    """False for a rank's tagged line whose last JSON object is cut short; True for any other."""
    tag, body = _ours(line)
    if tag is None:
        return True
    try:
        json.JSONDecoder().raw_decode(body.rstrip("\r\n").split(tag)[-1])
    except ValueError:
        return False
    return True


def _ours(line: str) -> tuple[str | None, str]:
    """One of our tagged lines' tag (a failure, a result, progress) and its text from the tag on;
    (None, "") for any other line."""
    match = PREFIX.match(line)
    body = line[match.end():] if match else ""
    tag = next((t for t in (TAG, RESULT_TAG, ERROR_TAG) if body.startswith(t)), None)
    return (tag, body) if tag else (None, "")


def tagged(body: str, tag: str) -> list[dict]:
    """The JSON objects behind `tag` in a line: one, or several where processes sharing a rank's
    output (its DataLoader workers) wrote theirs into one line; a piece cut short is left out."""
    found = []
    for piece in body.split(tag)[1:]:
        try:
            value, _ = json.JSONDecoder().raw_decode(piece)
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


class Spliced:
    """A rank's line that its heartbeat cut (the heartbeat thread writes whole lines to stderr, and
    one landed inside a progress bar's line, which tqdm ends with no newline until the bar is done,
    or never: leave=False) made whole again: the heartbeat passes on, and the piece of text before
    it is held and goes on with that rank's next piece on that stream. Shown as it came, the bar's
    state at the heartbeat was a console line of its own ("epoch 1:  50%|█████ | 7/14", a helper's
    DDPM port), a bar tqdm then cleared. horovodrun prefixes each piece a rank ends with "\r", and
    one launcher line holds every rank's such pieces until one of them ends a line: each piece is
    held and joined by its own prefix."""

    def __init__(self):
        self.held: dict[tuple[str, str], str] = {}

    def feed(self, line: str) -> list[str]:
        if self.held:
            line = "\r".join(self._joined(piece) for piece in line.split("\r"))
        at = line.find(ALIVE_TAG)
        if at < 0:
            return [line]
        start = line.rfind("\r", 0, at) + 1  # the heartbeat's own piece
        match = PREFIX.match(line[start:at])
        if match is None or start + match.end() == at:  # nothing of the rank's before it in its piece
            return [line]
        self.held[match.group(1, 2)] = line[start:at]
        return [line[:start] + match.group(0) + line[at:]]

    def _joined(self, piece: str) -> str:
        match = PREFIX.match(piece)
        held = self.held.pop(match.group(1, 2), None) if match else None
        if held is None:
            return piece
        if piece[match.end():].startswith(TAG_MARK):  # one of our lines (Ray's one stream): the text apart
            return held + "\r" + piece
        return held + piece[match.end():]

    def rest(self) -> list[str]:
        """What is still held (a rank's bar that never ended its line), as lines."""
        rest = [text + "\n" for text in self.held.values()]
        self.held.clear()
        return rest


def settled(line: str) -> list[str]:
    """A line as it reached the launcher, less the progress bar's updates in it: tqdm and its
    kind redraw a line with "\r" many times a second, and horovodrun passes on each redraw with
    its rank's prefix, which would be a console line each. What is kept is the line's last
    state (the bar as it ended: the last part with text, "\r\n" included), and any of our own
    tagged lines caught between the redraws."""
    if "\r" not in line:
        return [line]
    parts = line.split("\r")

    def raw(part: str) -> str:
        match = PREFIX.match(part)
        return (part[match.end():] if match else part).rstrip("\n")

    def text(part: str) -> str:
        return raw(part).strip()

    ours = [part + "\n" for part in parts[:-1] if TAG_MARK in part]
    # the line's last state: its last part with anything but the line's end ("a line\r\n" ends in
    # none); blank, the bar was cleared (tqdm's leave=False), and nothing is left on a terminal
    last = next((part for part in reversed(parts) if raw(part)), parts[-1])
    if not text(last):
        return ours
    tagged = PREFIX.match(parts[0])
    if tagged and not PREFIX.match(last):  # one prefix for all its redraws (mpirun's, the Ray driver's)
        last = tagged.group(0) + last
    return [*ours, last.rstrip("\n") + "\n"]


MPI_TAG = re.compile(r"\[\d+,\d+\]<(?:stdout|stderr)>:")

EXITED = r"Process (\d+) exit with status code (-?\d+)\."
"""horovodrun's own word that a rank exited, with its rank and exit code (supervise.EXIT_LINE)."""

RAN_ON = re.compile(rf"(?<=[^\r])(?:\[\d+\]<(?:stdout|stderr)>:|{EXITED})")
"""A line of horovodrun's inside a line, after anything but a "\r" (after one, it is the next
piece of a progress bar's line: Spliced, settled): a rank's tagged line, or its word that a rank
exited; the text before it was a rank's last line, cut short."""


def untangled(line: str) -> list[str]:
    """mpirun --tag-output's line as the lines the ranks wrote. Open MPI 4 tags each chunk a rank
    writes, not each line, so one console line can hold two ranks' lines ("[1,0]<stdout>:a[1,1]<stdout>:b")
    or end in a tag of its own (a newline written apart: "[1,1]<stdout>:a[1,1]<stdout>:").
    horovodrun tags whole lines, but a rank's last one cut short (killed mid-print) is passed on
    without a newline when its pipe closes, and the next line ran on after it: rank 0's failure
    report read as rank 1's text, and the job ended with no error named; horovodrun's "Process 1
    exit with status code -9." went unread, and the rank's SIGKILL unsaid. One of our tagged lines
    whose JSON is whole to the line's end is not cut (a failure's message may quote such a line).
    Other lines come back as they are."""
    starts = [m.start() for m in MPI_TAG.finditer(line)]
    if not _ours_whole(line):
        starts += [m.start() for m in RAN_ON.finditer(line)]
    if len(starts) < 2 and not (starts and starts[0] > 0):
        return [line]
    cuts = sorted({0, *starts, len(line)})
    parts = [line[a:b] for a, b in zip(cuts, cuts[1:])]
    return [p.rstrip("\n") + "\n" for p in parts if MPI_TAG.sub("", p, count=1).strip()]  # not a tag alone


def _ours_whole(line: str) -> bool:
    """Whether `line` is one of our tagged lines whose JSON runs whole to its end."""
    tag, body = _ours(line)
    try:
        return tag is not None and isinstance(json.loads(body[len(tag):]), dict)
    except ValueError:
        return False
