import { Text } from "@fluentui/react-components";
import { tokensPerSecond, type StreamOutcome } from "../api/streams";
import { useT } from "../i18n/I18nContext";

/** Token usage and speed of the last reply (usage comes from stream_options.include_usage). */
export function UsageLine({ outcome, testId }: { outcome: StreamOutcome | null; testId: string }) {
  const t = useT();
  if (outcome === null || outcome.usage === null) return null;
  const speed = tokensPerSecond(outcome);
  const { prompt_tokens: prompt, completion_tokens: completion, total_tokens: total } = outcome.usage;
  return (
    <Text size={200} data-testid={testId}>
      {t("usageLine", { prompt, completion, total })}
      {speed !== null && <> · <span data-testid={`${testId}-speed`}>{t("speedLine", { speed: speed.toFixed(1) })}</span></>}
    </Text>
  );
}
