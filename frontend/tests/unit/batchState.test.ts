import { describe, expect, it } from "vitest";
import {
  batchReducer,
  countByStatus,
  deltasFromChunk,
  initialBatchState,
  type BatchAction,
  type BatchState,
} from "../../src/batch/batchState";

function run(actions: BatchAction[], from: BatchState = initialBatchState): BatchState {
  return actions.reduce(batchReducer, from);
}

const delta = (index: number, content: string, finishReason: string | null = null) => ({ index, content, finishReason });

describe("batchReducer", () => {
  it("starts with every item pending", () => {
    const state = run([{ type: "start", count: 5 }]);
    expect(state.phase).toBe("generating");
    expect(countByStatus(state.items)).toEqual({ pending: 5, running: 0, done: 0, error: 0, aborted: 0 });
  });

  it.each([0, 1001, 2.5])("refuses a count of %s", (count) => {
    expect(() => run([{ type: "start", count }])).toThrow(RangeError);
  });

  it("appends each row's text and marks it running, then done on its finish reason", () => {
    const state = run([
      { type: "start", count: 3 },
      { type: "deltas", deltas: [delta(0, "Hel"), delta(2, "x")] },
      { type: "deltas", deltas: [delta(0, "lo", "stop")] },
    ]);
    expect(state.items.map((item) => [item.status, item.text, item.finishReason])).toEqual([
      ["done", "Hello", "stop"],
      ["pending", "", null],
      ["running", "x", null],
    ]);
    expect(state.doneCount).toBe(1);
  });

  it("ignores rows outside the batch and news for rows already done", () => {
    const state = run([
      { type: "start", count: 2 },
      { type: "deltas", deltas: [delta(1, "a", "length"), delta(5, "ghost"), delta(-1, "ghost")] },
      { type: "deltas", deltas: [delta(1, "late")] },
    ]);
    expect(state.items[1]).toEqual({ status: "done", text: "a", finishReason: "length" });
    expect(state.items).toHaveLength(2);
    expect(state.doneCount).toBe(1);
  });

  it("stop marks running and pending items aborted and keeps finished ones", () => {
    const state = run([
      { type: "start", count: 3 },
      { type: "deltas", deltas: [delta(0, "done", "stop"), delta(1, "half")] },
      { type: "stopped" },
    ]);
    expect(state.phase).toBe("stopped");
    expect(state.items.map((item) => item.status)).toEqual(["done", "aborted", "aborted"]);
    expect(state.items[1]?.text, "an aborted item keeps the text it had").toBe("half");
  });

  it("[DONE] finishes the batch and closes rows the server left open", () => {
    const state = run([
      { type: "start", count: 2 },
      { type: "deltas", deltas: [delta(0, "a", "stop"), delta(1, "b")] },
      { type: "completed" },
    ]);
    expect(state.phase).toBe("finished");
    expect(state.items.map((item) => item.status)).toEqual(["done", "done"]);
    expect(state.doneCount).toBe(2);
  });

  it("a failure marks open items as errors and keeps the server's message", () => {
    const state = run([
      { type: "start", count: 2 },
      { type: "deltas", deltas: [delta(0, "a", "stop")] },
      { type: "failed", message: "batch of 2 is over the limit of 1" },
    ]);
    expect(state.phase).toBe("failed");
    expect(state.error).toBe("batch of 2 is over the limit of 1");
    expect(state.items.map((item) => item.status)).toEqual(["done", "error"]);
  });

  it("ignores stream news after the batch was stopped", () => {
    const stopped = run([{ type: "start", count: 1 }, { type: "stopped" }]);
    expect(run([{ type: "deltas", deltas: [delta(0, "late", "stop")] }, { type: "completed" }], stopped)).toBe(stopped);
  });

  it("clear empties a finished batch but never a running one", () => {
    const running = run([{ type: "start", count: 1 }]);
    expect(batchReducer(running, { type: "clear" })).toBe(running);
    expect(run([{ type: "completed" }, { type: "clear" }], running)).toEqual(initialBatchState);
  });

  it("handles 1000 items with random deltas, counting every finished row once", () => {
    let state = run([{ type: "start", count: 1000 }]);
    const finished = new Set<number>();
    let seed = 12345;
    const random = () => ((seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31);
    for (let step = 0; step < 50; step += 1) {
      const deltas = Array.from({ length: 40 }, () => {
        const index = Math.floor(random() * 1000);
        const finish = random() < 0.3 ? "stop" : null;
        if (finish) finished.add(index);
        return delta(index, "t", finish);
      });
      state = batchReducer(state, { type: "deltas", deltas });
    }
    expect(state.doneCount).toBe(finished.size);
    expect(countByStatus(state.items).done).toBe(finished.size);
  });
});

describe("deltasFromChunk", () => {
  it("reads the rows of a native batch chunk", () => {
    const chunk = {
      object: "chat.completion.chunk",
      choices: [
        { index: 3, delta: { content: "hi" }, finish_reason: null },
        { index: 0, delta: {}, finish_reason: "length" },
      ],
    };
    expect(deltasFromChunk(chunk)).toEqual([delta(3, "hi"), delta(0, "", "length")]);
  });

  it("yields nothing for payloads without choices", () => {
    expect(deltasFromChunk({ object: "something.else" })).toEqual([]);
    expect(deltasFromChunk(null)).toEqual([]);
    expect(deltasFromChunk("text")).toEqual([]);
  });
});
