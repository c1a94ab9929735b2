/** The state of one batch generation: one item per prompt copy, fed by the native batch stream. */

export type ItemStatus = "pending" | "running" | "done" | "error" | "aborted";
export type BatchPhase = "idle" | "generating" | "finished" | "stopped" | "failed";

export interface BatchItem {
  readonly status: ItemStatus;
  readonly text: string;
  readonly finishReason: string | null;
}

export interface BatchState {
  readonly phase: BatchPhase;
  readonly items: readonly BatchItem[];
  readonly doneCount: number;
  readonly error: string | null;
}

/** One row's news from a stream chunk (`choices[i]` of a native batch chunk). */
export interface BatchDelta {
  index: number;
  content: string;
  finishReason: string | null;
}

export type BatchAction =
  | { type: "start"; count: number }
  | { type: "deltas"; deltas: readonly BatchDelta[] }
  | { type: "completed" }
  | { type: "stopped" }
  | { type: "failed"; message: string }
  | { type: "clear" };

export const MAX_BATCH_COUNT = 1000;

export const initialBatchState: BatchState = { phase: "idle", items: [], doneCount: 0, error: null };

const PENDING: BatchItem = { status: "pending", text: "", finishReason: null };

export function batchReducer(state: BatchState, action: BatchAction): BatchState {
  switch (action.type) {
    case "start": {
      if (!Number.isInteger(action.count) || action.count < 1 || action.count > MAX_BATCH_COUNT) {
        throw new RangeError(`batch count must be an integer within 1-${MAX_BATCH_COUNT}, got ${action.count}`);
      }
      return { phase: "generating", items: new Array<BatchItem>(action.count).fill(PENDING), doneCount: 0, error: null };
    }
    case "deltas":
      return state.phase === "generating" ? applyDeltas(state, action.deltas) : state;
    case "completed":
      // [DONE]: the server has nothing more for any row, so rows it left open are finished too.
      return state.phase === "generating" ? settle(state, "finished", "done", null) : state;
    case "stopped":
      return state.phase === "generating" ? settle(state, "stopped", "aborted", null) : state;
    case "failed":
      return state.phase === "generating" ? settle(state, "failed", "error", action.message) : state;
    case "clear":
      return state.phase === "generating" ? state : initialBatchState;
  }
}

function applyDeltas(state: BatchState, deltas: readonly BatchDelta[]): BatchState {
  if (deltas.length === 0) return state;
  const items = state.items.slice();
  let doneCount = state.doneCount;
  for (const delta of deltas) {
    const item = items[delta.index];
    // Rows the batch does not have, or rows already closed, cannot change any more.
    if (item === undefined || (item.status !== "pending" && item.status !== "running")) continue;
    const finished = delta.finishReason !== null;
    items[delta.index] = {
      status: finished ? "done" : "running",
      text: item.text + delta.content,
      finishReason: delta.finishReason,
    };
    if (finished) doneCount += 1;
  }
  return { ...state, items, doneCount };
}

function settle(state: BatchState, phase: BatchPhase, openItemsBecome: ItemStatus, error: string | null): BatchState {
  let doneCount = state.doneCount;
  const items = state.items.map((item) => {
    if (item.status !== "pending" && item.status !== "running") return item;
    if (openItemsBecome === "done") doneCount += 1;
    return { ...item, status: openItemsBecome };
  });
  return { phase, items, doneCount, error };
}

/** Reads the rows of one native batch chunk; anything else in the stream yields no deltas. */
export function deltasFromChunk(payload: unknown): BatchDelta[] {
  if (typeof payload !== "object" || payload === null) return [];
  const choices = (payload as { choices?: unknown }).choices;
  if (!Array.isArray(choices)) return [];
  const deltas: BatchDelta[] = [];
  for (const choice of choices) {
    if (typeof choice !== "object" || choice === null) continue;
    const { index, delta, finish_reason: finishReason } = choice as {
      index?: unknown;
      delta?: { content?: unknown };
      finish_reason?: unknown;
    };
    if (typeof index !== "number") continue;
    deltas.push({
      index,
      content: typeof delta?.content === "string" ? delta.content : "",
      finishReason: typeof finishReason === "string" ? finishReason : null,
    });
  }
  return deltas;
}

/** Counts per status, for the strip's header and tests. */
export function countByStatus(items: readonly BatchItem[]): Record<ItemStatus, number> {
  const counts: Record<ItemStatus, number> = { pending: 0, running: 0, done: 0, error: 0, aborted: 0 };
  for (const item of items) counts[item.status] += 1;
  return counts;
}
