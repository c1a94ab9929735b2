import { useEffect, useRef, useState, type KeyboardEvent } from "react";
import {
  Button,
  Card,
  MessageBar,
  MessageBarBody,
  MessageBarTitle,
  Text,
  Textarea,
  Title3,
  tokens,
} from "@fluentui/react-components";
import { isAbortError } from "../api/errors";
import { streamChat, type ChatMessage, type StreamOutcome } from "../api/streams";
import type { PageProps } from "./pageProps";
import { useT } from "../i18n/I18nContext";
import { SamplingForm } from "../components/SamplingForm";
import { UsageLine } from "../components/UsageLine";
import { useErrorText } from "../components/useErrorText";

interface ShownMessage extends ChatMessage {
  stopped?: boolean;
}

export function ChatPage({
  client,
  settings,
  update,
}: PageProps) {
  const t = useT();
  const [messages, setMessages] = useState<ShownMessage[]>([]);
  const [draft, setDraft] = useState("");
  const [reply, setReply] = useState<string | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [lastOutcome, setLastOutcome] = useState<StreamOutcome | null>(null);
  const controller = useRef<AbortController | null>(null);
  const log = useRef<HTMLDivElement>(null);
  const errorText = useErrorText();
  const busy = reply !== null;

  // Follow the conversation as it grows, as chat apps do.
  useEffect(() => {
    log.current?.scrollTo({ top: log.current.scrollHeight });
  }, [messages, reply]);

  const generate = async (history: ShownMessage[]) => {
    const abort = new AbortController();
    controller.current = abort;
    setMessages(history);
    setError(null);
    setReply("");
    let partial = "";
    const request = history.map(({ role, content }) => ({ role, content }));
    try {
      const outcome = await streamChat(client, request, settings.chatSampling, abort.signal, (delta) => {
        partial += delta;
        setReply(partial);
      });
      setLastOutcome(outcome);
      setMessages([...history, { role: "assistant", content: outcome.text }]);
    } catch (caught) {
      if (partial !== "" || isAbortError(caught)) {
        setMessages([...history, { role: "assistant", content: partial, stopped: true }]);
      }
      if (!isAbortError(caught)) setError(errorText(caught));
    } finally {
      controller.current = null;
      setReply(null);
    }
  };

  const send = () => {
    if (busy || draft.trim() === "") return;
    const history: ShownMessage[] = [...messages, { role: "user", content: draft }];
    setDraft("");
    void generate(history);
  };

  const regenerate = () => {
    const lastUser = messages.map((message) => message.role).lastIndexOf("user");
    if (busy || lastUser === -1) return;
    void generate(messages.slice(0, lastUser + 1));
  };

  const onKeyDown = (event: KeyboardEvent<HTMLTextAreaElement>) => {
    if (event.key === "Enter" && !event.shiftKey && !event.nativeEvent.isComposing) {
      event.preventDefault();
      send();
    }
  };

  return (
    <div style={{ display: "flex", gap: 16, alignItems: "flex-start", minHeight: 0 }}>
      <div style={{ flexGrow: 1, display: "flex", flexDirection: "column", gap: 12, minWidth: 0 }}>
        <Card ref={log} style={{ minHeight: 320, maxHeight: "60vh", overflowY: "auto" }} data-testid="chat-log">
          {messages.length === 0 && !busy && <Text>{t("chatEmpty")}</Text>}
          {messages.map((message, index) => (
            <MessageView key={index} message={message} />
          ))}
          {reply !== null && <MessageView message={{ role: "assistant", content: reply }} streaming />}
        </Card>
        {error && (
          <MessageBar intent="error" layout="multiline" data-testid="chat-error">
            <MessageBarBody>
              <MessageBarTitle>{t("requestFailed")}</MessageBarTitle>
              <span style={{ whiteSpace: "pre-wrap" }}>{error}</span>
            </MessageBarBody>
          </MessageBar>
        )}
        <Textarea
          resize="vertical"
          rows={3}
          value={draft}
          placeholder={t("chatPlaceholder")}
          onChange={(_, data) => setDraft(data.value)}
          onKeyDown={onKeyDown}
          data-testid="chat-input"
        />
        <div style={{ display: "flex", gap: 8, alignItems: "center", flexWrap: "wrap" }}>
          <Button appearance="primary" disabled={busy || draft.trim() === ""} onClick={send} data-testid="chat-send">
            {t("chatSend")}
          </Button>
          <Button disabled={!busy} onClick={() => controller.current?.abort()} data-testid="chat-stop">
            {t("chatStop")}
          </Button>
          <Button disabled={busy || !messages.some((m) => m.role === "user")} onClick={regenerate} data-testid="chat-regenerate">
            {t("chatRegenerate")}
          </Button>
          <Button disabled={busy} onClick={() => (setMessages([]), setLastOutcome(null), setError(null))}>
            {t("chatClear")}
          </Button>
          <UsageLine outcome={lastOutcome} testId="chat-usage" />
        </div>
      </div>
      <Card style={{ width: 220, flexShrink: 0 }}>
        <Title3>{t("samplingTitle")}</Title3>
        <SamplingForm value={settings.chatSampling} onChange={(next) => update({ chatSampling: next })} testIdPrefix="chat" />
      </Card>
    </div>
  );
}

function MessageView({ message, streaming = false }: { message: ShownMessage; streaming?: boolean }) {
  const t = useT();
  const isUser = message.role === "user";
  return (
    <div
      data-testid={isUser ? "chat-user-message" : "chat-assistant-message"}
      data-streaming={streaming ? "true" : "false"}
      style={{
        alignSelf: isUser ? "flex-end" : "flex-start",
        maxWidth: "85%",
        padding: "8px 12px",
        borderRadius: 8,
        background: isUser ? tokens.colorBrandBackground2 : tokens.colorNeutralBackground3,
      }}
    >
      <Text size={200} weight="semibold" block>
        {isUser ? t("chatUser") : t("chatAssistant")}
      </Text>
      <span style={{ whiteSpace: "pre-wrap", overflowWrap: "anywhere" }}>{message.content}</span>
      {message.stopped && <Text size={200} italic> {t("chatStopped")}</Text>}
    </div>
  );
}
